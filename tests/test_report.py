"""`blocklab report`: sections in order, written as they finish, kept on failure."""

import contextlib
import importlib
import io
import json

import pytest

from blocklab.cli import main
from blocklab.commands import COMMANDS
from blocklab.report import write_report


@pytest.fixture
def stub_sections(monkeypatch):
    """Replace every section by a marker; returns the list of sections called."""
    called = []
    for name in COMMANDS:
        module = importlib.import_module(f"blocklab.commands.{name}")

        def section(out_dir, *, quick, _name=name):
            called.append((_name, quick))
            return f"## {_name} section\n\nbody of {_name}\n"

        monkeypatch.setattr(module, "report_section", section)
    return called


def test_every_section_in_order_with_its_time(stub_sections, tmp_path):
    path = write_report(tmp_path / "out", quick=True)
    text = path.read_text()
    assert path == tmp_path / "out" / "report.md"
    assert text.startswith("# blocklab report\n") and "(quick mode" in text
    assert stub_sections == [(name, True) for name in COMMANDS]
    positions = [text.index(f"## {name} section") for name in COMMANDS]
    assert positions == sorted(positions)
    for name in COMMANDS:
        assert f"_({name}: " in text


def test_only_runs_the_named_sections(stub_sections, tmp_path):
    text = write_report(tmp_path, only=["signal", "census"]).read_text()
    assert [n for n, _ in stub_sections] == ["census", "signal"]  # report order
    assert "## train section" not in text and "(quick mode" not in text


def test_a_failing_section_keeps_the_finished_ones(
    stub_sections, monkeypatch, tmp_path
):
    def broken(out_dir, *, quick):
        raise RuntimeError("section failed")

    monkeypatch.setattr(
        importlib.import_module("blocklab.commands.train"), "report_section", broken
    )
    with pytest.raises(RuntimeError, match="section failed"):
        write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    before = COMMANDS[: COMMANDS.index("train")]
    assert before and all(f"body of {name}" in text for name in before)
    assert "## signal section" not in text


def test_cli_writes_a_real_census_section_and_json(tmp_path):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert (
            main(["report", "--only", "census", "--out", str(tmp_path), "--json"]) == 0
        )
    path = tmp_path / "report.md"
    assert json.loads(out.getvalue()) == {"report": str(path)}
    text = path.read_text()
    # The chapter's census of the default d = 256 block (hand-counted:
    # 4 d^2 attention, 3 d f SwiGLU with f = 683, two d-wide gains).
    assert "787200" in text and "524544" in text and "262144" in text
