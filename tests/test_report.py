"""`blocklab report`: sections in order, written as they finish, kept on failure,
sized to the machine (reduced on a CPU, full with --full or on an accelerator)."""

import contextlib
import importlib
import io
import json

import pytest

from blocklab.cli import main, report
from blocklab.cli.commands import REPORT_SECTIONS
from blocklab.cli.report import write_report
from blocklab.experiments.protocol import study


@pytest.fixture
def stub_sections(monkeypatch):
    """Replace every study's section by a marker; returns the calls (name, kwargs).

    Every stub has the one signature of the protocol (`out_dir, *, quick, full,
    progress`); lr_sensitivity estimates 600 s, the others 1 s."""
    called = []
    for name in REPORT_SECTIONS:
        module = study(name).module

        def section(out_dir, *, quick, full, progress, _name=name):
            called.append((_name, {"quick": quick, "full": full}))
            return f"## {_name} section\n\nbody of {_name}\n"

        seconds = 600.0 if name == "lr_sensitivity" else 1.0
        monkeypatch.setattr(
            module, "report_estimate", lambda *, quick, full, _s=seconds: _s
        )
        monkeypatch.setattr(module, "report_section", section)
    return called


def test_every_section_in_order_with_its_time(stub_sections, tmp_path):
    path = write_report(tmp_path / "out", quick=True)
    text = path.read_text()
    assert path == tmp_path / "out" / "report.md"
    assert text.startswith("# blocklab report\n") and "(quick mode" in text
    assert [n for n, _ in stub_sections] == list(REPORT_SECTIONS)
    assert all(kw["quick"] for _, kw in stub_sections)
    positions = [text.index(f"## {name} section") for name in REPORT_SECTIONS]
    assert positions == sorted(positions)
    for name in REPORT_SECTIONS:
        assert f"_({name}: " in text
    assert "in progress" not in text  # the finished report has no progress note


def test_only_runs_the_named_sections(stub_sections, tmp_path):
    text = write_report(tmp_path, only=["signal", "census"], full=False).read_text()
    assert [n for n, _ in stub_sections] == ["census", "signal"]  # report order
    assert "## activations section" not in text and "(quick mode" not in text


def test_on_a_cpu_the_long_section_is_reduced_and_full_is_said(
    stub_sections, tmp_path, monkeypatch
):
    monkeypatch.setattr(report, "on_accelerator", lambda: False)
    text = write_report(tmp_path, only=["lr_sensitivity"]).read_text()
    assert stub_sections == [("lr_sensitivity", {"quick": False, "full": False})]
    assert "`blocklab report --full`" in text


def test_on_an_accelerator_or_with_full_every_section_is_full(
    stub_sections, tmp_path, monkeypatch
):
    monkeypatch.setattr(report, "on_accelerator", lambda: True)
    write_report(tmp_path, only=["lr_sensitivity"])
    monkeypatch.setattr(report, "on_accelerator", lambda: False)
    text = write_report(
        tmp_path, only=["lr_sensitivity", "census"], full=True
    ).read_text()
    assert stub_sections == [
        ("lr_sensitivity", {"quick": False, "full": True}),
        ("census", {"quick": False, "full": True}),
        ("lr_sensitivity", {"quick": False, "full": True}),
    ]
    assert "(full protocol)" in text


def test_cli_full_flag_and_estimates(stub_sections, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(report, "on_accelerator", lambda: False)
    assert main(["report", "--out", str(tmp_path), "--full"]) == 0
    assert ("lr_sensitivity", {"quick": False, "full": True}) in stub_sections
    assert all(flags == {"quick": False, "full": True} for _, flags in stub_sections)
    err = capsys.readouterr().err
    # 5 sections of 1 s and one of 600 s: 605 s is 10 min; the long one is named
    assert "about 10 min on 2 CPU cores" in err
    assert "lr_sensitivity: about 10 min" in err
    assert "census: about" not in err  # short sections get no line of their own


def test_every_section_gets_the_same_flags(stub_sections, tmp_path, monkeypatch):
    """One signature: every section receives quick, full and progress."""
    module = importlib.import_module("blocklab.experiments.activations")
    seen = []

    def section(out_dir, *, quick, full, progress):
        seen.append((quick, full, progress))
        return "## activations\n"

    monkeypatch.setattr(module, "report_section", section)
    monkeypatch.setattr(report, "on_accelerator", lambda: False)
    write_report(tmp_path, only=["activations", "census"], progress=False)
    write_report(tmp_path, only=["activations"], full=True, progress=True)
    assert seen == [(False, False, False), (False, True, True)]
    assert stub_sections == [("census", {"quick": False, "full": False})]


def test_only_accepts_command_names_and_aliases(stub_sections, tmp_path, capsys):
    """`--only` takes a study by its name, its command or an old alias."""
    write_report(tmp_path, only=["train", "lr-sensitivity"], progress=False)
    assert [n for n, _ in stub_sections] == ["activations", "lr_sensitivity"]
    argv = ["report", "--out", str(tmp_path), "--only", "nope", "--json"]
    assert main(argv) == 2
    err = json.loads(capsys.readouterr().out)
    assert err["type"] == "ConfigError" and "'nope'" in err["error"]


def test_report_calls_no_signature_inspection():
    """report.py calls every section the same way: no `inspect` in it."""
    import inspect as inspect_module

    source = inspect_module.getsource(report)
    assert "import inspect" not in source and "signature(" not in source


def test_real_estimates_fit_the_cpu_budget():
    """The estimates the report prints: about 15 min on 2 CPU cores by default,
    the full protocols far longer, quick mode a few minutes."""

    from blocklab.experiments.protocol import STUDIES

    def total(**kw):
        return sum(s.estimate(**kw) for s in STUDIES)

    # What the report prints: measured section times where the timing run
    # has them, the formulas elsewhere. The formulas alone are upper bounds.
    printed, _ = report.estimate_sections(STUDIES, quick=False, full=False)
    assert 600 < sum(printed.values()) < 17 * 60
    assert sum(printed.values()) < total(quick=False, full=False) < 20 * 60
    assert total(quick=False, full=True) > 3600
    assert total(quick=True, full=False) < 8 * 60


def test_quick_and_full_exclude_each_other(tmp_path, capsys):
    assert main(["report", "--out", str(tmp_path), "--quick", "--full", "--json"]) == 2
    assert "error" in json.loads(capsys.readouterr().out)
    with pytest.raises(ValueError, match="exclude"):
        write_report(tmp_path, quick=True, full=True)


def test_a_failing_section_keeps_the_finished_ones(
    stub_sections, monkeypatch, tmp_path
):
    def broken(out_dir, *, quick, full, progress):
        raise RuntimeError("section failed")

    monkeypatch.setattr(
        importlib.import_module("blocklab.experiments.activations"),
        "report_section",
        broken,
    )
    with pytest.raises(RuntimeError, match="section failed"):
        write_report(tmp_path)
    text = (tmp_path / "report.md").read_text()
    before = REPORT_SECTIONS[: REPORT_SECTIONS.index("activations")]
    assert before and all(f"body of {name}" in text for name in before)
    assert "## signal section" not in text
    assert f"in progress: {len(REPORT_SECTIONS) - 2} more sections to come" in text


def test_an_earlier_report_survives_until_a_section_finishes(
    stub_sections, monkeypatch, tmp_path
):
    old = "# blocklab report\n\nan earlier, complete report\n"
    (tmp_path / "report.md").write_text(old)

    def interrupted(out_dir, *, quick, full, progress):
        raise KeyboardInterrupt

    monkeypatch.setattr(
        importlib.import_module("blocklab.experiments.parameter_census"),
        "report_section",
        interrupted,
    )
    with pytest.raises(KeyboardInterrupt):
        write_report(tmp_path)
    assert (tmp_path / "report.md").read_text() == old  # never a bare header
    assert [p.name for p in tmp_path.iterdir()] == ["report.md"]  # no temp files


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


# ------------------------------------------- one source for the report's times
def test_the_estimate_comes_from_the_measured_times(stub_sections, tmp_path,
                                                    monkeypatch, capsys):  # fmt: skip
    """A section measured in the mode's timing run is estimated by its measured
    seconds (not the study's formula: 1 s and 600 s here); one not measured by
    the formula, and the line says which."""
    import blocklab.experiments.timing as timing

    times = tmp_path / "times.json"
    times.write_text(json.dumps({"modes": {"cpu": {
        "date": "2030-01-02", "machine": "test machine", "total_seconds": 1250,
        "sections": {name: 5.0 for name in REPORT_SECTIONS
                     if name not in ("census", "lr_sensitivity")}
        | {"lr_sensitivity": 1200.0},
    }}}))  # fmt: skip
    monkeypatch.setattr(timing, "REPORT_TIMES", times)
    monkeypatch.setattr(
        report, "report_estimates",
        lambda formulas, **kw: timing.report_estimates(formulas, path=times, **kw),
    )  # fmt: skip
    monkeypatch.setattr(report, "on_accelerator", lambda: False)
    write_report(tmp_path / "out", only=["census", "lr_sensitivity", "signal"])
    err = capsys.readouterr().err
    # 1200 (measured) + 5 (measured) + 1 (census: the formula) = 1206 s = 20 min
    assert "3 sections, about 20 min on 2 CPU cores" in err
    assert "2 sections measured 2030-01-02, test machine; census estimated" in err
    assert "lr_sensitivity: about 20 min" in err


def test_a_finished_report_records_its_times(stub_sections, tmp_path):
    """The report's last line gives the total and the mode; a timing run writes
    the sections' times into the JSON the estimate reads."""
    from blocklab.experiments import timing

    path = write_report(tmp_path / "out", quick=True, progress=False)
    mode, sections, total = timing.parse_report_times(path.read_text())
    assert mode == "quick" and list(sections) == list(REPORT_SECTIONS)
    assert 0 <= total < 60
    times = tmp_path / "times.json"
    entry = timing.record_report_times(path, machine="m", date="2030-01-01",
                                       path=times)  # fmt: skip
    assert timing.measured_report_times("quick", times) == entry
    assert timing.measured_report_times("cpu", times) is None
    assert entry["sections"].keys() == set(REPORT_SECTIONS)


def test_the_readme_and_install_page_quote_the_measured_times():
    """The README's figure and the install page's per-section times are the
    package's report_times.json (one source; a timing run updates it)."""
    from pathlib import Path

    from blocklab.experiments import timing

    root = Path(__file__).resolve().parents[1]
    cpu = timing.measured_report_times("cpu")
    took = (
        f"took {timing.format_duration(cpu['total_seconds'])} end to end ({cpu['date']}"
    )
    assert took in " ".join((root / "README.md").read_text().split())
    install = " ".join((root / "docs" / "install.md").read_text().split())
    assert (
        f"{cpu['date']}): {timing.format_duration(cpu['total_seconds'])}**" in install
    )
    for name, seconds in cpu["sections"].items():
        label = {"activations": "train", "lr_sensitivity": "exercise 11"}.get(
            name, name
        )
        assert f"{label} {seconds:g} s" in install, (name, seconds)


def test_format_duration_by_hand():
    from blocklab.experiments.timing import format_duration

    assert format_duration(679) == "11 min 19 s"
    assert format_duration(42.4) == "42 s" and format_duration(60) == "1 min 0 s"
