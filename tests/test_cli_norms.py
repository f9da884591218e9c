"""`blocklab norms`: JSON schema, exercise 9's arithmetic, the report section."""

import contextlib
import io
import json
import math

import pytest

from blocklab.cli import main
from blocklab.commands import norms

SHAPE = (4, 8, 16)
MODES = ("fresh", "donated")
FIELDS = ("ms", "best_ms", "gbps", "passes")


@pytest.fixture(scope="module")
def result():
    # Run the CLI once for every test of this file.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["norms", "--shape", *map(str, SHAPE), "--reps", "2", "--json"]
        assert main(args) == 0
    return json.loads(out.getvalue())


def test_json_has_every_row_and_field(result):
    assert result["shape"] == list(SHAPE) and result["reps"] == 2
    assert result["bytes_x"] == 4 * math.prod(SHAPE)
    rows = result["rows"]
    expected = {"blocklab rms_norm", "blocklab layer_norm", "eqx RMSNorm"}
    expected |= {"eqx LayerNorm", "X -> 2X", "rms_norm, jit donate only"}
    try:
        import flax.nnx  # noqa: F401

        expected |= {"nnx RMSNorm", "nnx LayerNorm"}
    except ImportError:
        pass
    assert set(rows) == expected
    for label, row in rows.items():
        assert set(row) == {f"{m}_{f}" for m in MODES for f in FIELDS}
        for mode in MODES:
            if label == "rms_norm, jit donate only" and mode == "fresh":
                assert row["fresh_ms"] is None
                continue
            ms, gbps = row[f"{mode}_ms"], row[f"{mode}_gbps"]
            assert ms > 0 and row[f"{mode}_best_ms"] <= ms
            # One read and one write of X in the measured median time.
            assert gbps == pytest.approx(2 * result["bytes_x"] / (ms * 1e-3) / 1e9)


def test_passes_are_relative_to_two_x(result):
    rows = result["rows"]
    for mode in MODES:
        assert rows["X -> 2X"][f"{mode}_passes"] == pytest.approx(1.0)
        ours = rows["blocklab rms_norm"]
        # passes = t x bandwidth(2X) / (2 |X|) = t / t(2X)
        expected = ours[f"{mode}_ms"] / rows["X -> 2X"][f"{mode}_ms"]
        assert ours[f"{mode}_passes"] == pytest.approx(expected)


def test_minimal_bytes_and_flops_per_element(result):
    # Hand count for X of 512 float32 values, d = 16: read X and the d gains (and
    # d shifts), write Y; RMSNorm 4 flops per element (square, add, two scalings),
    # LayerNorm 7 (sum, subtract, square, add, two scalings, shift).
    size, d = math.prod(SHAPE), SHAPE[-1]
    assert result["cost"]["rms"]["bytes"] == 4 * (2 * size + d)
    assert result["cost"]["layer"]["bytes"] == 4 * (2 * size + 2 * d)
    assert result["cost"]["rms"]["flops_per_element"] == 4
    assert result["cost"]["layer"]["flops_per_element"] == 7


def test_ours_agree_with_peers(result):
    # Equinox and Flax compute the same functions independently (float32).
    assert result["max_deviation"]
    for name, dev in result["max_deviation"].items():
        assert dev < 5e-6, name


def test_ratios_are_bandwidth_ratios(result):
    rows, ratios = result["rows"], result["ratios"]
    r = rows["blocklab rms_norm"]["donated_gbps"] / rows["X -> 2X"]["donated_gbps"]
    assert ratios["blocklab rms_norm donated / 2X donated"] == pytest.approx(r)
    best = (
        rows["X -> 2X"]["donated_best_ms"]
        / rows["blocklab rms_norm"]["donated_best_ms"]
    )
    assert ratios[
        "blocklab rms_norm donated / 2X donated (best rounds)"
    ] == pytest.approx(best)
    assert all(v > 0 for v in ratios.values())


def test_report_section_writes_table_and_png(tmp_path, monkeypatch):
    monkeypatch.setitem(norms.REPORT_RUNS, True, (SHAPE, 2))
    md = norms.report_section(tmp_path, quick=True)
    assert md.startswith("## ")
    assert "| blocklab rms_norm |" in md and "passes" in md
    assert "(norms_bandwidth.png)" in md
    png = tmp_path / "norms_bandwidth.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
