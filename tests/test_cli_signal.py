"""`blocklab signal`: JSON, table, figures, exercises and the report section."""

import contextlib
import io
import json

import numpy as np
import pytest

from blocklab import signal as sg
from blocklab.cli import main
from blocklab.commands import signal as cmd

ARGS = [
    "signal",
    "--blocks",
    "4",
    "--seeds",
    "2",
    "--num-hiddens",
    "16",
    "--placements",
    "post",
    "pre",
]
OPTS = dict(num_blks=4, num_hiddens=16, num_heads=4, qk_norm=False, alpha=1.0, ffn=True)


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("signal")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*ARGS, "--json", "--out", str(out), "--exercises", "4"]) == 0
    return json.loads(buf.getvalue()), out


def test_json_is_the_seed_mean_of_the_vmapped_sweep(json_run):
    data, _ = json_run
    assert set(data) == {"post", "pre", "exercises"}
    for placement in ("post", "pre"):
        stats = sg.signal_sweep(placement, 2, **OPTS)
        for field in cmd.FIELDS:
            np.testing.assert_allclose(
                data[placement][field],
                np.asarray(getattr(stats, field)).mean(0),
                rtol=1e-6,
                err_msg=field,
            )
        for name in sg.PROJECTIONS:
            np.testing.assert_allclose(
                data[placement]["grad_norms"][name],
                np.asarray(stats.grad_norms[name]).mean(0),
                rtol=1e-6,
                err_msg=name,
            )
        assert len(data[placement]["stream_rms"]) == 4


def test_post_ln_json_stream_rms_is_one(json_run):
    data, _ = json_run
    # LayerNorm with unit gain and zero shift: RMS sqrt(var / (var + eps)) ~ 1.
    np.testing.assert_allclose(data["post"]["stream_rms"], 1.0, atol=1e-4)


def test_exercise_4_budget_is_one_plus_the_running_sum_of_branch_mean_squares(json_run):
    data, _ = json_run
    ex4 = data["exercises"]["4"]
    c = np.asarray(ex4["c_attn"]) + np.asarray(ex4["c_ffn"])
    np.testing.assert_allclose(ex4["budget"], 1 + np.cumsum(c), rtol=1e-6)
    rms = np.asarray(sg.signal_sweep("pre", 2, **OPTS).stream_rms)
    np.testing.assert_allclose(ex4["measured"], (rms**2).mean(0), rtol=1e-6)
    assert set(ex4["fits"]) == {"1-4"}


def test_figures_are_written_one_per_quantity(json_run):
    _, out = json_run
    names = sorted(p.name for p in out.glob("*.png"))
    assert names == [
        "signal_entropy.png",
        "signal_grad_wq.png",
        "signal_rms.png",
        "signal_spread.png",
    ]
    for p in out.glob("*.png"):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_table_lists_each_placement_with_the_chapter_columns(tmp_path, capsys):
    assert main([*ARGS, "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert (
        "| placement | stream RMS k=4 | spread k=1 | spread k=2 | spread k=4 |" in text
    )
    rows = [line for line in text.splitlines() if line.startswith(("| post", "| pre"))]
    assert len(rows) == 2 and all(line.count("[") == 8 for line in rows)


def test_checkpoints_are_the_chapters_blocks_at_depth_32():
    assert cmd.checkpoints(32) == [8, 16, 32]
    assert cmd.checkpoints(1) == [1]


@pytest.mark.parametrize("flag", ["--seeds", "--blocks"])
def test_non_positive_sizes_are_rejected(flag):
    with pytest.raises(SystemExit, match=f"{flag} must be >= 1, got 0"):
        main(["signal", flag, "0"])


def test_unknown_placement_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["signal", "--placements", "middle"])
    assert "invalid choice: 'middle'" in capsys.readouterr().err


@pytest.mark.slow
def test_report_section_links_its_figures(tmp_path):
    section = cmd.report_section(tmp_path, quick=True)
    assert section.startswith("## Signal propagation at initialization")
    for name in (
        "signal_grad_wq.png",
        "signal_spread.png",
        "signal_rms.png",
        "signal_entropy.png",
    ):
        assert f"]({name})" in section and (tmp_path / name).exists()
    for heading in (
        "Exercise 7",
        "Exercise 4",
        "Exercise 5",
        "Exercise 6c",
        "Exercise 3c",
    ):
        assert heading in section
