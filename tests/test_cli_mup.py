"""`blocklab mup`: verdicts with their thresholds, an estimate and progress
(issue 37, item 5). The study itself is tests/test_mup.py; here its result is
built by hand, so the verdicts are checked against hand-worked values."""

import json

import numpy as np
import pytest

from blocklab.cli import main
from blocklab.experiments import mup as study


def _coord(name, final):
    """A CoordCheckResult whose slopes after the last step are `final`."""
    widths, steps = (16, 32, 64), np.arange(3)
    slopes = {a: np.array([0.0, 0.0, final[a]]) for a in study.ACTIVATIONS}
    rms = {a: np.ones((3, 3)) for a in study.ACTIVATIONS}
    return study.CoordCheckResult(widths, steps, rms, slopes, name, 1e-2)


def _result(protocol, mup_max, std_max, transfer=None):
    flat = dict.fromkeys(study.ACTIVATIONS, 0.01)
    return study.MupResult(
        protocol,
        {
            "standard": _coord("standard", {**flat, "ffn_out": std_max}),
            "mup": _coord("mup", {**flat, "attn_logits": -mup_max}),
        },
        transfer,
    )


def test_verdicts_against_the_protocols_threshold():
    p = study.PROTOCOLS["quick"]
    t = p.max_slope
    res = _result(p, mup_max=t - 0.01, std_max=t + 0.3)
    v = {x["parametrization"]: x for x in res.verdicts()}
    assert v["mup"]["passed"] and v["mup"]["expected"]
    assert v["mup"]["value"] == pytest.approx(t - 0.01)  # |-(t - 0.01)|
    assert not v["standard"]["passed"] and not v["standard"]["expected"]
    assert v["standard"]["threshold"] == t
    # just above the threshold fails: the rule is |slope| <= max_slope
    res = _result(p, mup_max=t + 1e-6, std_max=t + 0.3)
    assert not {x["parametrization"]: x for x in res.verdicts()}["mup"]["passed"]
    assert "FAIL (unexpected)" in res.verdict_table()


def test_transfer_verdict_counts_grid_steps():
    p = study.PROTOCOLS["cpu"]
    tr = study.TransferResult(
        (16, 32, 64), (1e-3, 1e-2, 1e-1), (0,),
        {"mup": np.zeros((3, 3, 1)), "standard": np.zeros((3, 3, 1))},
        {"mup": np.array([1, 1, 2]), "standard": np.array([2, 1, 0])}, 10, 16,
    )  # fmt: skip
    res = _result(p, 0.0, 1.0, tr)
    v = {(x["check"], x["parametrization"]): x for x in res.verdicts()}
    assert v["learning-rate transfer", "mup"]["value"] == 1  # 2 - 1
    assert v["learning-rate transfer", "mup"]["passed"]  # <= 1 grid step
    assert v["learning-rate transfer", "standard"]["value"] == 2
    assert not v["learning-rate transfer", "standard"]["passed"]


def test_every_protocol_has_a_threshold_and_an_estimate():
    for name, p in study.PROTOCOLS.items():
        assert 0 < p.max_slope < 1, name
        assert study.estimate_seconds(p) > 0
    # fewer, smaller widths give noisier slopes: the thresholds say so
    assert study.PROTOCOLS["full"].max_slope < study.PROTOCOLS["quick"].max_slope


@pytest.fixture
def fake_study(monkeypatch):
    calls = []

    def run_study(protocol, *, progress=False):
        calls.append((protocol.name, progress))
        return _result(protocol, mup_max=0.1, std_max=0.6)

    monkeypatch.setattr(study, "run_study", run_study)
    monkeypatch.setattr(study.MupResult, "figures", lambda self, out: [])
    return calls


def test_the_command_prints_verdicts_an_estimate_and_progress(fake_study, capsys,
                                                             tmp_path):  # fmt: skip
    assert main(["mup", "--protocol", "quick", "--out", str(tmp_path)]) == 0
    out, err = capsys.readouterr()
    t = study.PROTOCOLS["quick"].max_slope
    assert "Verdicts (protocol `quick`)" in out
    assert f"<= {t:g}" in out and "PASS" in out and "FAIL (expected: no μP)" in out
    assert "blocklab mup: protocol quick, about" in err and "2 CPU cores" in err
    assert fake_study == [("quick", True)]  # progress on by default
    assert main(["mup", "--protocol", "quick", "--out", str(tmp_path),
                 "--no-progress", "--json"]) == 0  # fmt: skip
    out, err = capsys.readouterr()
    verdicts = json.loads(out)["verdicts"]
    assert {(v["parametrization"], v["passed"], v["threshold"]) for v in verdicts} == {
        ("mup", True, t),
        ("standard", False, t),
    }
    assert "about" not in err and fake_study[-1] == ("quick", False)


def test_run_study_passes_progress_to_the_coordinate_check(monkeypatch):
    seen = []

    def coord_check(make_model, widths, steps, **kw):
        seen.append(kw["progress"])
        return _coord(kw["label"], dict.fromkeys(study.ACTIVATIONS, 0.0))

    monkeypatch.setattr(study, "coord_check", coord_check)
    study.run_study(study.PROTOCOLS["quick"], progress=True)
    assert seen == [True, True]
