"""The small-scale-proxies study (blocklab.experiments.proxies).

References: hand-worked sensitivities and verdicts on a result built by hand;
`lm_loss` for the z-loss objective; exercise 11 against the chapter's own
optimizer path (`train_sweep` with its default AdamW); a QUICK run (slow) end
to end.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab.experiments import lr_sensitivity as ex11
from blocklab.experiments import proxies
from blocklab.experiments.lr_sensitivity import lr_sensitivity

P = proxies.ProxiesProtocol("t", (16, 32), (1, 2), (1e-3, 1e-2, 1e-1), 10)


def _result(sens, attn, opt):
    """A result whose LRS, max attention logits and optimum index are given."""
    val, init, a, o = {}, {}, {}, {}
    for k in sens:
        v = np.full(3, 3.0)
        v[opt.get(k, 1)] = 2.0
        val[k], init[k] = v, 3.0
        a[k] = np.full(3, attn.get(k, 5.0))
        o[k] = np.full(3, 10.0)
    return proxies.ProxiesResult(P, tuple(sorted({k[0] for k in sens})), val, init,
                                 dict(sens), a, o)  # fmt: skip


def test_points_cover_width_then_depth():
    assert P.points() == [(16, 1), (32, 1), (16, 2)]


def test_findings_by_hand():
    pts = P.points()
    sens = {}
    table = {  # variant -> LRS at (16,1), (32,1), (16,2)
        "baseline": (0.10, 0.20, 0.40),
        "qk_norm": (0.08, 0.10, 0.30),
        "mup": (0.09, 0.18, 0.35),
        "long_warmup": (0.12, 0.25, 0.45),
        "indep_wd": (0.05, 0.10, 0.20),
    }
    for v, vals in table.items():
        for (w, n), s in zip(pts, vals, strict=True):
            sens[(v, w, n)] = s
    attn = {("baseline", 32, 1): 50.0, ("qk_norm", 32, 1): 4.0}
    opt = {("baseline", 16, 1): 2, ("baseline", 32, 1): 0}
    f = {d["finding"]: d for d in _result(sens, attn, opt).findings()}
    assert f["QK-norm removes attention-logit growth and lowers LR sensitivity"][
        "agrees"
    ]
    assert f["LR sensitivity still rises with size (width)"]["agrees"]
    mup = f["μP stabilizes the optimal rate across widths but not the sensitivity"]
    assert mup["agrees"] and "0 grid steps (μP) vs 2" in mup["measured"]
    assert not f["longer warm-up lowers LR sensitivity"]["agrees"]
    assert f["independent weight decay lowers LR sensitivity"]["agrees"]
    # per doubling: depth 0.40 - 0.10 = +0.30, width 0.20 - 0.10 = +0.10
    depth = f["depth hurts (raises LRS) more than width"]
    assert (
        depth["agrees"]
        and "+0.300" in depth["measured"]
        and "+0.100" in depth["measured"]
    )
    text = _result(sens, attn, opt).findings_table()
    assert "does not agree" in text and "agrees" in text
    assert {d["verdict"] for d in f.values()} == {"agrees", "does not agree"}

    # Within the margin (10 % of the larger LRS), or no standard optimum shift
    # to stabilize: inconclusive, whichever side the small difference falls.
    sens[("qk_norm", 32, 1)] = 0.19  # vs 0.20: 5 %
    for k, x in zip(pts, (0.105, 0.21, 0.41), strict=True):  # warm-up: 2.4 %
        sens[("long_warmup", *k)] = x
    f = {d["finding"]: d for d in _result(sens, attn, {}).findings()}
    qk, mup = (next(k for k in f if k.startswith(w)) for w in ("QK-norm", "μP"))
    for name in (qk, mup, "longer warm-up lowers LR sensitivity"):
        assert f[name]["verdict"] == "inconclusive" and not f[name]["agrees"]
    assert "0 grid steps (μP) vs 0" in f[mup]["measured"]


def test_lr_sensitivity_by_hand():
    # l0 = 3: capped losses (2, 2.5, 3 (diverged), 3 (above l0)); l* = 2
    assert math.isclose(
        lr_sensitivity([2.0, 2.5, None, 4.0], 3.0), (0 + 0.5 + 1 + 1) / 4
    )


def test_z_loss_objective_is_lm_loss(key):
    model = bl.CharLM(12, 16, 2, 1, max_len=8, key=key)
    X = jax.random.randint(jax.random.key(1), (2, 8), 0, 12)
    Y = jax.random.randint(jax.random.key(2), (2, 8), 0, 12)
    got = proxies.ZLossNextToken(0.3)(model, (X, Y))
    assert math.isclose(float(got), float(bl.lm_loss(model, X, Y, z_loss=0.3)))


@pytest.mark.slow  # 15-40 s; the study's parts have default tests above
def test_exercise_11_is_a_point_of_the_proxies_study(monkeypatch):
    """`lr_sensitivity.run_study` trains through `proxies.run_point` (a spy sees
    each model's call: its variant, (d, N), the rates, a constant rate), and its
    numbers are the chapter's: the same losses and logits as `train_sweep`
    with its default optimizer (AdamW, weight decay 0) on a CharLM built by
    hand."""
    p = ex11.LRProtocol("t", 16, 1, 4, 8, 2, 4, 2, 2)
    lrs = (1e-3, 3e-2)
    data = bl.TimeMachine(seq_len=p.seq_len)
    calls, real = [], proxies.run_point

    def spy(variant, width, depth, rates, **kw):
        calls.append((variant, width, depth, tuple(rates), kw["schedule"]))
        return real(variant, width, depth, rates, **kw)

    monkeypatch.setattr(proxies, "run_point", spy)
    got = ex11.run_study(p, lrs, seed=3, data=data)
    V = proxies.VARIANTS
    assert calls == [
        (V["qk_norm"], 16, 1, lrs, False),
        (V["baseline"], 16, 1, lrs, False),
    ]

    # The reference: the model without QK-norm (the other differs by one flag).
    stride = max(1, data.num_train // p.probe_batch)
    probe = ex11.LogitProbe(data.windows(jnp.arange(p.probe_batch) * stride)[0])

    def make(key):
        return bl.CharLM(data.vocab_size, 16, 4, 1, max_len=8, key=key)

    ref = bl.train_sweep(
        make,
        data,
        p.steps,
        model_keys=[3, 3],
        data_keys=[4, 4],
        run=bl.RunConfig(batch_size=p.batch_size, steps_per_call=2, progress=False),
        sweep=bl.SweepConfig(learning_rates=list(lrs), probe=probe, validate=False),
    )
    losses = np.asarray(ref.losses, np.float64).reshape(2, 2, 2).mean(-1)
    np.testing.assert_allclose(got.loss_curves["no_qk_norm"], losses, rtol=2e-5)
    for k in ("attn", "out"):
        mine = got.max_attn_logit if k == "attn" else got.max_output_logit
        np.testing.assert_allclose(
            mine["no_qk_norm"], np.asarray(ref.probes[k]), rtol=2e-5
        )
    # the larger rate moved the model: the comparison is not of two inits
    assert np.ptp(got.loss_curves["no_qk_norm"][:, -1]) > 1e-2


def test_bad_input_is_named():
    with pytest.raises(bl.ConfigError, match="variants"):
        proxies.run_study(proxies.QUICK, ("baseline", "nope"))
    with pytest.raises(bl.ConfigError, match="ProxiesProtocol"):
        proxies.run_study("quick")


@pytest.mark.slow
def test_quick_study_end_to_end(tmp_path):
    p = proxies.ProxiesProtocol("tiny", (16, 32), (1, 2), (1e-3, 1e-2), 8,
                                seq_len=8, batch_size=4, record_every=4)  # fmt: skip
    res = proxies.run_study(p, ("baseline", "qk_norm"))
    for k, s in res.sensitivity.items():
        assert math.isclose(s, lr_sensitivity(res.val_loss[k], res.init_loss[k]))
        assert res.max_attn_logit[k].shape == (2,)
    assert len(res.findings()) == 3  # QK-norm, width, depth
    assert [q.name for q in res.figures(tmp_path)] == [
        "proxies_width.png",
        "proxies_depth.png",
    ]
