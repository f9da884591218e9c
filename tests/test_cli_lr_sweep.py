"""`blocklab lr-sweep`: JSON schema, sensitivity, logit probe and decision rule."""

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from strict_json import strict_loads

from blocklab import CharLM, state_dict
from blocklab.cli import main
from blocklab.cli.commands import lr_sensitivity as cmd
from blocklab.experiments import lr_sensitivity as lr_sweep

TINY = [
    "--steps", "4", "--record-every", "2", "--num-hiddens", "16", "--num-blks", "1",
    "--batch-size", "2", "--seq-len", "8", "--no-progress",
]  # fmt: skip


def test_sensitivity_hand_worked():
    # capped at l0 = 4: [1, 2, 4 (diverged), 4]; l* = 1; mean of [0, 1, 3, 3].
    assert lr_sweep.lr_sensitivity([1.0, 2.0, math.nan, 5.0], 4.0) == 1.75
    assert lr_sweep.lr_sensitivity([3.0, 3.0], 4.0) == 0.0


def test_exercise_learning_rates():
    np.testing.assert_allclose(
        lr_sweep.LRS, [1e-4, 10**-3.5, 1e-3, 10**-2.5, 1e-2, 10**-1.5, 1e-1], rtol=1e-12
    )


@pytest.mark.parametrize("qk_norm", [False, True])
def test_logit_probe_matches_a_numpy_float64_reference(qk_norm):
    T, d, heads = 6, 16, 4
    model = CharLM(28, d, heads, 1, max_len=T, qk_norm=qk_norm, key=jax.random.key(1))
    tokens = jnp.asarray([[3, 7, 0, 12, 27, 5], [1, 1, 2, 9, 4, 0]], jnp.int32)
    got = lr_sweep.LogitProbe(tokens)(model)
    sd = state_dict(model.stack.block(0))
    emb = np.asarray(model.token_emb.weight, np.float64)
    pos = np.asarray(model.pos_emb.weight, np.float64)
    attn_max = 0.0
    for t in np.asarray(tokens):
        x = ref.rms_norm(emb[t] + pos[:T], sd["norm1.weight"])
        _, _, logits = ref.attention(sd, x, heads)
        causal = np.tril(np.ones((T, T), bool))
        attn_max = max(attn_max, np.abs(logits[:, causal]).max())
    assert float(got["attn"]) == pytest.approx(attn_max, rel=1e-5)
    out_max = max(float(jnp.abs(model(t)).max()) for t in tokens)
    assert float(got["out"]) == pytest.approx(out_max, rel=1e-6)


def _verdict(attn_no, attn_qk, out_no, out_qk, final=(2.0, 2.5)):
    final = {"qk_norm": [final[0]], "no_qk_norm": [final[1]]}
    attn = {"qk_norm": [np.array(attn_qk)], "no_qk_norm": [np.array(attn_no)]}
    out = {"qk_norm": [np.array(out_qk)], "no_qk_norm": [np.array(out_no)]}
    return lr_sweep.verdicts(final, attn, out)


def test_decision_rule():
    # Attention logits 5 -> 60 (12x growth, 6x the QK model's 10): attention.
    (v,) = _verdict([5, 60], [5, 10], [1, 1], [1, 1])
    assert v["explained_by"] == "attention logits" and v["gap"] == pytest.approx(0.5)
    # Attention grew only 4x; output logits 3x the QK model's: output.
    (v,) = _verdict([5, 20], [5, 5], [1, 30], [1, 10])
    assert v["explained_by"] == "output logits"
    # Neither grew: neither.
    (v,) = _verdict([5, 6], [5, 5], [1, 11], [1, 10])
    assert v["explained_by"] == "neither"
    # A diverged no-QK-norm model ends worse (gap unknown).
    (v,) = _verdict([5, 6], [5, 5], [1, 11], [1, 10], final=(2.0, math.nan))
    assert v["gap"] is None
    # No gap (within GAP nats): no verdict.
    assert _verdict([5, 60], [5, 5], [1, 1], [1, 1], final=(2.0, 2.01)) == []


def test_quick_protocol_and_overrides():
    parser = argparse.ArgumentParser()
    cmd.add_arguments(parser)
    assert cmd.protocol_of(parser.parse_args(["--quick"])) is lr_sweep.QUICK
    assert cmd.protocol_of(parser.parse_args([])) is lr_sweep.FULL
    p = cmd.protocol_of(parser.parse_args(["--quick", "--steps", "60"]))
    assert p.steps == 60 and p.num_hiddens == 64 and p.name == "custom"
    with pytest.raises(ValueError, match="steps must be >= record_every"):
        cmd.protocol_of(parser.parse_args(["--steps", "5"]))


def test_the_protocols_are_the_exercises_and_named():
    full = lr_sweep.FULL
    assert (full.num_hiddens, full.num_blks, full.num_heads, full.seq_len,
            full.batch_size, full.steps, full.record_every) == (
            256, 6, 4, 128, 64, 1000, 100)  # fmt: skip
    assert {p.name for p in (lr_sweep.FULL, lr_sweep.CPU, lr_sweep.QUICK)} == {
        "full", "cpu", "quick"}  # fmt: skip
    assert lr_sweep.report_protocol(quick=False, full=False) is lr_sweep.CPU
    assert lr_sweep.report_protocol(quick=True) is lr_sweep.QUICK
    assert lr_sweep.report_protocol(full=True) is lr_sweep.FULL


def test_cli_json_schema(tmp_path, capsys):
    out = tmp_path / "plots"
    argv = ["lr-sweep", "--json", *TINY, "--lrs", "1e-2", "1e30", "--out", str(out)]
    assert main(argv) == 0
    r = strict_loads(capsys.readouterr().out)
    for key in ("lrs", "final_loss", "sensitivity", "max_attn_logit",
                "max_output_logit", "diverged", "diverged_at", "protocol"):  # fmt: skip
        assert key in r
    assert r["lrs"] == [1e-2, 1e30] and r["protocol"]["name"] == "custom"
    assert r["steps"] == [0, 2, 4]
    for m in ("qk_norm", "no_qk_norm"):
        assert len(r["final_loss"][m]) == 2
        # The absurd rate diverges (reported, not raised); the other does not.
        assert r["diverged_at"][m][0] == 0 and r["diverged_at"][m][1] >= 1
        assert r["final_loss"][m][1] is None and r["final_loss"][m][0] is not None
        assert np.asarray(r["max_attn_logit"][m]).shape == (2, 3)  # steps 0, 2, 4
        # An untrained character model: every logit near 0, loss near log 28.
        assert r["initial_loss"][m] == pytest.approx(math.log(28), abs=0.1)
        # Two rates, one diverged (capped at l0): the sensitivity lies between 0
        # and half of l0 minus the surviving rate's final loss.
        gap = r["initial_loss"][m] - r["final_loss"][m][0]
        assert 0.0 <= r["sensitivity"][m] <= max(gap, 0.0) / 2 + 1e-6
    assert {(d["model"], d["lr"]) for d in r["diverged"]} == {
        ("qk_norm", 1e30), ("no_qk_norm", 1e30)}  # fmt: skip
    # the log axis of the final-loss figure spans 1e-2 .. 1e30 and survives it
    assert sorted(p.name for p in out.iterdir()) == [
        "lr_attn_logits_no_qk_norm.png",
        "lr_attn_logits_qk_norm.png",
        "lr_final_loss.png",
        "lr_output_logits_no_qk_norm.png",
        "lr_output_logits_qk_norm.png",
    ]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in out.iterdir())


def test_cli_table(tmp_path, capsys):
    argv = ["lr-sweep", *TINY, "--lrs", "1e-2", "1e30", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "learning-rate sensitivity" in text and "| 1.00e-02 |" in text
    assert "| 1.00e+30 | diverged | diverged |" in text


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--lrs=-1e-3"], "lrs[0] must lie in (0.0, inf]"),
        (["--lrs", "0"], "lrs[0] must lie in (0.0, inf]"),
        (["--lrs", "1e-3", "1e-3"], "lrs must be distinct"),
        (["--lrs", "inf"], "lrs[0] must be finite"),
        (["--seed", "-1"], "--seed must lie in [0, 4294967295], got -1"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--record-every", "0"], "--record-every must be >= 1, got 0"),
        (["--quick", "--steps", "5"], "steps must be >= record_every"),
    ],
)
def test_bad_values_are_refused_before_any_training(bad, message, monkeypatch, capsys):
    monkeypatch.setattr(lr_sweep, "run_study", lambda *a, **k: 1 / 0)
    assert main(["lr-sweep", *bad, "--json"]) == 2
    assert message in strict_loads(capsys.readouterr().out)["error"]


def test_help_says_a_diverged_run_exits_0(capsys):
    assert main(["lr-sweep", "--help", "--json"]) == 0
    text = " ".join(strict_loads(capsys.readouterr().out)["help"].split())
    assert "the exit status is 0" in text


def test_study_flops_hand_worked_and_cpu_warning(capsys):
    # d=4, 1 block, T=3: per token 6*12*1*16 + 12*1*3*4 = 1296; 2 models x 1 rate
    # x 1 step x 1 x 3 tokens.
    tiny = lr_sweep.LRProtocol("t", 4, 1, 1, 3, 1, 1, 1)
    assert lr_sweep.study_flops(tiny, [1e-3]) == 2 * 3 * 1296
    # The exercise's protocol: 14 runs of 1000 steps at d = 256, 6 blocks.
    full = lr_sweep.study_flops(lr_sweep.FULL, lr_sweep.LRS)
    assert 3.4e15 < full < 3.6e15
    cmd.warn_if_slow(lr_sweep.QUICK, lr_sweep.LRS)
    assert capsys.readouterr().err == ""
    cmd.warn_if_slow(lr_sweep.FULL, lr_sweep.LRS)
    err = capsys.readouterr().err
    if jax.default_backend() == "cpu":
        assert "3.5 PFLOP" in err and "5 h on a 2-core CPU" in err and "--quick" in err
    else:
        assert err == ""
