"""`blocklab lr-sweep`: JSON schema, sensitivity, logit probe and decision rule."""

import argparse
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

from blocklab import CharLM, state_dict
from blocklab.cli import main
from blocklab.commands import lr_sweep

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
    lr_sweep.add_arguments(parser)
    assert lr_sweep.protocol_of(parser.parse_args(["--quick"])) == lr_sweep.QUICK
    assert lr_sweep.protocol_of(parser.parse_args([])) == lr_sweep.FULL
    p = lr_sweep.protocol_of(parser.parse_args(["--quick", "--steps", "60"]))
    assert p["steps"] == 60 and p["num_hiddens"] == lr_sweep.QUICK["num_hiddens"]
    with pytest.raises(ValueError, match="steps must be >= record_every"):
        lr_sweep.protocol_of(parser.parse_args(["--steps", "5"]))


def test_cli_json_schema(tmp_path, capsys):
    out = tmp_path / "plots"
    argv = ["lr-sweep", "--json", *TINY, "--lrs", "1e-2", "1e30", "--out", str(out)]
    assert main(argv) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("lrs", "final_loss", "sensitivity", "max_attn_logit",
                "max_output_logit", "diverged"):  # fmt: skip
        assert key in r
    assert r["lrs"] == [1e-2, 1e30]
    for m in ("qk_norm", "no_qk_norm"):
        assert len(r["final_loss"][m]) == 2
        # The absurd rate diverges (reported, not raised); the other does not.
        assert r["diverged"][m][0] == 0 and r["diverged"][m][1] >= 1
        assert r["final_loss"][m][1] is None
        assert np.asarray(r["max_attn_logit"][m]).shape == (2, 3)  # steps 0, 2, 4
        # Sensitivity from the reported numbers (a diverged loss counts as l0).
        l0 = r["initial_loss"][m]
        capped = [min(x, l0) if x is not None else l0 for x in r["final_loss"][m]]
        assert r["sensitivity"][m] == pytest.approx(
            np.mean(np.subtract(capped, min(capped)))
        )
    assert r["steps"] == [0, 2, 4]
    assert sorted(p.name for p in out.iterdir()) == [
        "lr_attn_logits_no_qk_norm.png",
        "lr_attn_logits_qk_norm.png",
        "lr_final_loss.png",
        "lr_output_logits_no_qk_norm.png",
        "lr_output_logits_qk_norm.png",
    ]


def test_cli_table(tmp_path, capsys):
    argv = ["lr-sweep", *TINY, "--lrs", "1e-2", "1e30", "--out", str(tmp_path)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "learning-rate sensitivity" in text and "| 1.00e-02 |" in text


def test_study_flops_hand_worked_and_cpu_warning(capsys):
    # d=2, 1 block, T=3: per token 6*12*1*4 + 12*1*3*2 = 360; 2 models x 1 rate
    # x 1 step x 1 x 3 tokens.
    tiny = dict(num_hiddens=2, num_blks=1, seq_len=3, steps=1, batch_size=1)
    assert lr_sweep.study_flops(tiny, [1e-3]) == 2 * 3 * 360
    # The exercise's protocol: 14 runs of 1000 steps at d = 256, 6 blocks.
    full = lr_sweep.study_flops(lr_sweep.FULL, lr_sweep.LRS)
    assert 3.4e15 < full < 3.6e15
    lr_sweep.warn_if_slow(lr_sweep.QUICK, lr_sweep.LRS)
    assert capsys.readouterr().err == ""
    lr_sweep.warn_if_slow(lr_sweep.FULL, lr_sweep.LRS)
    err = capsys.readouterr().err
    if jax.default_backend() == "cpu":
        assert "3.5 PFLOP" in err and "5 h on a 2-core CPU" in err and "--quick" in err
    else:
        assert err == ""
