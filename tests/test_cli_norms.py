"""`blocklab norms`: JSON schema, exercise 9's arithmetic, the report section.

The arithmetic (bandwidth, passes, ratios) is checked on stubbed timings whose
answers are worked out by hand; one real run at a tiny size checks the schema
and that blocklab's norms agree with Equinox's and Flax's.
"""

import json
import types

import pytest

from blocklab.cli import main
from blocklab.experiments import norms as study

SHAPE = (4, 8, 16)  # 512 float32 values: |X| = 2048 bytes
MODES = ("fresh", "donated")
FIELDS = ("ms", "best_ms", "gbps", "passes")


def _strict(text):
    def refuse(token):
        raise ValueError(f"non-strict JSON token {token}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture(scope="module")
def result():
    # Run the CLI once, for real, for the tests that need it.
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        args = ["norms", "--shape", *map(str, SHAPE), "--reps", "2", "--json"]
        assert main(args) == 0
    return _strict(out.getvalue())


def test_json_has_every_row_and_field(result):
    assert result["shape"] == list(SHAPE) and result["reps"] == 2
    assert result["bytes_x"] == 2048
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
            assert row[f"{mode}_ms"] > 0
            assert row[f"{mode}_best_ms"] <= row[f"{mode}_ms"]


def test_minimal_bytes_and_flops_per_element(result):
    # Hand count for X of 512 float32 values, d = 16: read X and the d gains (and
    # d shifts), write Y; RMSNorm 4 flops per element (square, add, two scalings),
    # LayerNorm 7 (sum, subtract, square, add, two scalings, shift).
    assert result["cost"]["rms"]["bytes"] == 4 * (2 * 512 + 16)
    assert result["cost"]["layer"]["bytes"] == 4 * (2 * 512 + 2 * 16)
    assert result["cost"]["rms"]["flops_per_element"] == 4
    assert result["cost"]["layer"]["flops_per_element"] == 7


def test_ours_agree_with_peers(result):
    # Equinox and Flax compute the same functions independently (float32).
    assert result["max_deviation"]
    for name, dev in result["max_deviation"].items():
        assert dev < 5e-6, name


# Stubbed timings (ms): fresh, donated. "rms_norm, jit donate only" has no fresh.
TIMES = {
    "blocklab rms_norm": (4.0, 2.0),
    "blocklab layer_norm": (5.0, 4.0),
    "eqx RMSNorm": (8.0, 16.0),
    "eqx LayerNorm": (10.0, 5.0),
    "X -> 2X": (2.0, 1.0),
}


@pytest.fixture
def stubbed(monkeypatch):
    """Every implementation returns 2X; `time_call` reports the stubbed times."""

    def fn(ms):
        f = lambda x: 2 * x  # noqa: E731
        f.ms = ms
        return f

    def implementations(d, ndim, *, key):
        return {label: (fn(a), fn(b)) for label, (a, b) in TIMES.items()}

    def time_call(f, *args, **kwargs):
        return types.SimpleNamespace(median=f.ms / 1e3)

    monkeypatch.setattr(study, "implementations", implementations)
    monkeypatch.setattr(study, "time_call", time_call)


def test_bandwidth_passes_and_ratios_on_known_timings(stubbed):
    r = study.run_norms(shape=SHAPE, reps=3, progress=False)
    rows = r.rows
    # one read + one write of 2048 bytes in 4 ms: 4096 B / 4e-3 s = 1.024e-3 GB/s
    assert rows["blocklab rms_norm"]["fresh_gbps"] == pytest.approx(1.024e-3)
    assert rows["blocklab rms_norm"]["donated_gbps"] == pytest.approx(2.048e-3)
    assert rows["eqx RMSNorm"]["fresh_best_ms"] == pytest.approx(8.0)
    # passes: 4 ms against 2X's 2 ms (fresh) is 2 passes; 2 ms vs 1 ms donated, 2
    assert rows["blocklab rms_norm"]["fresh_passes"] == pytest.approx(2.0)
    assert rows["blocklab layer_norm"]["donated_passes"] == pytest.approx(4.0)
    assert rows["X -> 2X"]["donated_passes"] == pytest.approx(1.0)
    ratios = r.ratios
    assert ratios["blocklab rms_norm donated / 2X donated"] == pytest.approx(0.5)
    assert ratios["blocklab layer_norm donated / 2X donated"] == pytest.approx(0.25)
    # fastest RMS peer fresh: eqx at 8 ms; ours at 4 ms moves twice the bandwidth
    assert ratios["blocklab rms_norm fresh / fastest peer"] == pytest.approx(2.0)
    assert ratios["blocklab rms_norm donated / fastest peer"] == pytest.approx(8.0)
    assert ratios["blocklab layer_norm donated / fastest peer"] == pytest.approx(1.25)


def test_report_section_writes_table_and_png(tmp_path, monkeypatch, stubbed):
    from blocklab.experiments import norms as cmd

    monkeypatch.setitem(study.REPORT_RUNS, True, (SHAPE, 2))
    md = cmd.report_section(tmp_path, quick=True)
    assert md.startswith("## ")
    assert "| blocklab rms_norm | 4.00 | 0.0 | 2.00 | 2.00 | 0.0 | 2.00 |" in md
    # the slower in-place norm (layer, 0.25) is the one quoted
    assert "reaches 0.25 x the bandwidth of donated X -> 2X" in md
    assert "(norms_bandwidth.png)" in md
    png = tmp_path / "norms_bandwidth.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    "argv",
    [["--reps", "0"], ["--shape", "4", "0"], ["--seed", "-1"], ["--shape"]],
    ids=["reps0", "shape0", "seed-1", "noshape"],
)
def test_bad_arguments_exit_2_with_a_json_error(argv, capsys):
    assert main(["norms", *argv, "--json"]) == 2
    err = _strict(capsys.readouterr().out)
    assert set(err) == {"error", "type"} and err["error"]


def test_run_norms_validates_its_protocol():
    with pytest.raises(ValueError, match="reps"):
        study.run_norms(shape=SHAPE, reps=0)
    with pytest.raises(TypeError, match="shape"):
        study.run_norms(shape=(4, 2.5), reps=1)


def test_a_missing_peer_is_named_with_the_reason(monkeypatch, stubbed):
    """Without flax the Flax NNX rows are not left out silently: the table, the
    summary and the JSON name them and say why."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == "flax" else real(name, *a),
    )  # fmt: skip
    r = study.run_norms(shape=SHAPE, reps=1, progress=False)
    assert set(r.missing) == {"nnx RMSNorm", "nnx LayerNorm"}
    table = r.table()
    assert (
        "| nnx RMSNorm (missing: flax is not installed (pip install flax)) |" in table
    )
    assert "nnx LayerNorm (missing: flax is not installed" in table
    assert "not timed: nnx RMSNorm (flax is not installed" in r.summary()
    assert r.to_json()["missing"]["nnx LayerNorm"].startswith("flax is not installed")
