"""`blocklab.experiments`: activations, signal and lr_sensitivity from Python.

Argument checks before any work, the typed results' rendering (strict JSON,
tables, figures that survive non-finite values) on hand-built results, and
one tiny run per study against an independent value.
"""

import math

import numpy as np
import pytest
from strict_json import strict_round_trip

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.experiments import activations, lr_sensitivity, signal
from blocklab.experiments._seeds import check_seeds


# ------------------------------------------------------------------ seeds
def test_one_seed_rule():
    assert check_seeds([0, np.int64(3), 2**32 - 1], _owner="f") == (0, 3, 2**32 - 1)
    for bad, message in [
        ([1, 1], "must be distinct"),
        ([-1], r"seeds\[0\] must lie in \[0, 4294967295\], got -1"),
        ([2**32], "must lie in"),
        ([True], "must be an int"),
        ([1.5], "must be an int"),
        ([], "at least one seed"),
        (3, "a sequence of int seeds"),
    ]:
        with pytest.raises(ConfigError, match=message):
            check_seeds(bad, _owner="f")


# ------------------------------------------------------------ activations
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(seeds=(0, 0)), "must be distinct"),
        (dict(seeds=(-3,)), "must lie in"),
        (dict(steps=0), "steps must lie in"),
        (dict(lr=-1e-3), "lr must lie in"),
        (dict(lr=math.nan), "lr must be finite"),
        (dict(acts=("tanh",)), "acts must be among"),
        (dict(acts=()), "at least one activation"),
        (dict(num_hiddens=10, num_heads=4), "multiple of num_heads"),
    ],
)
def test_compare_activations_refuses_bad_protocols(kwargs, message):
    with pytest.raises(ValueError, match=message):
        activations.compare_activations(**kwargs)


@pytest.mark.slow
def test_compare_activations_tiny_run_starts_at_log_28(tmp_path):
    data = bl.TimeMachine(seq_len=8, num_train=200, num_val=10)
    r = activations.compare_activations(
        ("swiglu",), (3, 5), 3, num_hiddens=16, num_heads=2, num_blks=1,
        batch_size=4, data=data,
    )  # fmt: skip
    assert r.acts == ("swiglu",) and r.seeds == (3, 5)
    assert r.checkpoints == (1, 2, 3) and r.window == 1
    assert r.curves["swiglu"].shape == (2, 3)
    # window 1 at step 1: the untrained model's loss, every logit near 0, so
    # log 28 up to the sampling noise of 32 tokens (a few hundredths)
    np.testing.assert_allclose(r.loss_at["swiglu"]["1"], math.log(28), atol=0.1)
    # loss@k is the loss of step k itself (window 1): the curve's column k - 1
    np.testing.assert_array_equal(r.loss_at["swiglu"]["3"], r.curves["swiglu"][:, 2])
    assert r.diverged == []
    assert strict_round_trip(r.to_json())["protocol"]["seeds"] == [3, 5]
    assert r.plot(tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_activation_plot_survives_an_all_nan_curve(tmp_path):
    r = activations.ActivationComparison(
        protocol={"steps": 4}, acts=("gelu",), seeds=(0, 1), checkpoints=(1, 3, 4),
        window=1, loss_at={"gelu": {"1": [math.nan] * 2}},
        val_loss={"gelu": [math.nan] * 2},
        curves={"gelu": np.full((2, 4), np.nan)}, diverged_at={"gelu": [1, 1]},
    )  # fmt: skip
    assert r.plot(tmp_path / "nan.png").exists()
    assert strict_round_trip(r.to_json())["results"]["gelu"]["val_loss"] == [None, None]


@pytest.mark.slow  # 10-18 s
def test_activation_report_section_sizes_to_the_machine(tmp_path, monkeypatch):
    """cpu: seed 0, the protocol named and the way to the full one; full: seeds
    0-2 and no note; the progress flag reaches the training."""
    calls = []
    real = activations.compare_activations
    data = bl.TimeMachine(seq_len=8, num_train=200, num_val=10)

    results = []

    def tiny(acts, seeds, steps, **kw):
        calls.append((tuple(seeds), steps, kw.get("progress")))
        if not results:  # one real (tiny) run; the sections only differ in text
            results.append(real(acts, (0,), 3, num_hiddens=16, num_heads=2,
                                num_blks=1, batch_size=4, data=data))  # fmt: skip
        return results[0]

    monkeypatch.setattr(activations, "compare_activations", tiny)
    text = activations.report_section(tmp_path, progress=True)
    assert calls[-1] == ((0,), 600, True)
    assert "protocol `cpu`" in text and "`blocklab report --full`" in text
    assert "`blocklab activations --seeds 0 1 2`" in text
    # the note sits between the protocol's description and the table
    assert text.index("batches of") < text.index("protocol `cpu`") < text.index("|")
    text = activations.report_section(tmp_path, full=True)
    assert calls[-1] == ((0, 1, 2), 600, False) and "protocol `cpu`" not in text
    activations.report_section(tmp_path, quick=True)
    assert calls[-1] == ((0,), 90, False)
    assert (tmp_path / "train_losses.png").read_bytes()[:4] == b"\x89PNG"


# ----------------------------------------------------------------- signal
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(num_seeds=0), "num_seeds must lie in"),
        (dict(num_blks=0), "num_blks must lie in"),
        (dict(alpha=0.0), "alpha must lie in"),
        (dict(alpha=math.inf), "alpha must be finite"),
        (dict(num_hiddens=18), "multiple of num_heads"),
        (dict(placements=("pre", "pre")), "distinct"),
        (dict(placements=("middle",)), "must be among"),
    ],
)
def test_signal_propagation_refuses_bad_protocols(kwargs, message):
    with pytest.raises(ValueError, match=message):
        signal.signal_propagation(**kwargs)


def test_signal_arch_refuses_an_unknown_architecture():
    with pytest.raises(ValueError, match="arch must be one of"):
        signal.signal_arch("bert")


def _stats(rms, spread):
    n = len(rms)
    z = np.zeros((1, n))
    return bl.diagnostics.propagation.SignalStats(
        stream_rms=np.asarray([rms], float), token_spread=np.asarray([spread], float),
        c_attn=z + 0.25, c_ffn=z + 0.5, attn_entropy=z, max_logit=z,
        grad_norms={p: z for p in ("W_q", "W_k", "W_v", "W_o")},
    )  # fmt: skip


def test_exercise_3c_and_4_on_hand_built_statistics():
    # stream RMS sqrt(k): the head reads sqrt(D); the power law is exactly k^0.5
    n = 16
    pre = _stats(np.sqrt(np.arange(1, n + 1)), np.ones(n))
    ex3 = signal.exercise_3c(pre)
    np.testing.assert_array_equal(ex3.depth, [1, 2, 4, 8, 16])
    np.testing.assert_allclose(ex3.rms, np.sqrt([1, 2, 4, 8, 16]))
    ex4 = signal.exercise_4(pre)
    np.testing.assert_allclose(ex4.budget, 1 + 0.75 * np.arange(1, n + 1))
    np.testing.assert_allclose(ex4.measured, np.arange(1, n + 1))
    b, a = ex4.fits["8-16"]
    assert b == pytest.approx(0.5) and a == pytest.approx(1.0)
    assert "| 16 | 0.250 | 0.500 | 13.00 | 16.00 |" in ex4.table()
    # a flat start (RMS 3 up to block 7), then sqrt(k): the 8-16 fit sees only
    # the power law; the 1-16 fit does not
    k = np.arange(1, n + 1)
    bent = signal.exercise_4(_stats(np.where(k < 8, 3.0, np.sqrt(k)), np.ones(n)))
    b, a = bent.fits["8-16"]
    assert b == pytest.approx(0.5) and a == pytest.approx(1.0)
    assert bent.fits["1-16"][0] < 0.3


def test_signal_json_names_non_finite_placements(tmp_path):
    bad = _stats([1.0, math.inf], [0.5, math.nan])
    ok = _stats([1.0, 2.0], [0.5, 0.4])
    r = signal.SignalPropagation({"seeds": 1}, {"pre": bad, "post": ok})
    data = strict_round_trip(r.to_json())
    assert data["nonfinite"] == ["pre"]
    assert data["placements"]["pre"]["stream_rms"] == [1.0, None]
    assert len(r.plot(tmp_path)) == 4


def test_token_collapse_table_adds_the_closed_form():
    ex = signal.TokenCollapse(
        [1, 2], (1.0,), {"alpha=1, no FFN": np.array([0.5, 0.25])}
    )
    lines = ex.table().splitlines()
    # (1 + 2^k / 63)^(-1/2) at k = 1, 2
    want = [(1 + 2**k / 63) ** -0.5 for k in (1, 2)]
    assert lines[-1] == (
        f"| alpha=1, formula (no FFN, n = 64) | {want[0]:.1e} | {want[1]:.1e} |"
    )


# --------------------------------------------------------- lr_sensitivity
@pytest.mark.parametrize(
    "changes, message",
    [
        (dict(steps=0), "steps must lie in"),
        (dict(record_every=2000), "steps must be >= record_every"),
        (dict(num_heads=3), "multiple of num_heads"),
        (dict(batch_size=True), "batch_size must be an int"),
    ],
)
def test_lr_protocol_is_validated(changes, message):
    with pytest.raises(ValueError, match=message):
        lr_sensitivity.FULL.replace(**changes)


def test_run_study_refuses_bad_arguments():
    with pytest.raises(TypeError):  # the message, or the jaxtyping hook's
        lr_sensitivity.run_study({"steps": 3})
    for lrs, message in [((), "at least one"), ((1e-3, -1.0), r"lrs\[1\]"),
                         ((1e-3, 1e-3), "distinct")]:  # fmt: skip
        with pytest.raises(ValueError, match=message):
            lr_sensitivity.run_study(lr_sensitivity.QUICK, lrs)
    with pytest.raises(ValueError, match="seed must lie in"):
        lr_sensitivity.run_study(lr_sensitivity.QUICK, seed=-1)


def _lr_result(final_no, attn_no):
    lrs = (1e-3, 1e30)
    return lr_sensitivity.LRSensitivityResult(
        protocol=lr_sensitivity.QUICK, lrs=lrs, seed=0, steps=np.array([0, 30]),
        final_loss={"qk_norm": np.array([2.0, 2.1]), "no_qk_norm": np.array(final_no)},
        initial_loss={"qk_norm": 3.3, "no_qk_norm": 3.3},
        sensitivity={"qk_norm": 0.05, "no_qk_norm": 0.65},
        max_attn_logit={"qk_norm": np.array([[1.0, 2.0], [1.0, 3.0]]),
                        "no_qk_norm": np.array(attn_no)},
        max_output_logit={m: np.ones((2, 2)) for m in lr_sensitivity.MODELS},
        loss_curves={m: np.ones((2, 1)) for m in lr_sensitivity.MODELS},
        diverged_at={"qk_norm": np.array([0, 0]), "no_qk_norm": np.array([0, 7])},
        verdicts=lr_sensitivity.verdicts(
            {"qk_norm": [2.0, 2.1], "no_qk_norm": final_no},
            {"qk_norm": [[1.0, 2.0], [1.0, 3.0]], "no_qk_norm": attn_no},
            {m: np.ones((2, 2)) for m in lr_sensitivity.MODELS},
        ),
    )  # fmt: skip


def test_lr_result_json_table_and_figures_with_a_diverged_run(tmp_path):
    r = _lr_result([2.0, math.nan], [[1.0, 2.0], [1.0, math.inf]])
    data = strict_round_trip(r.to_json())
    assert data["final_loss"]["no_qk_norm"] == [2.0, None]
    assert data["diverged"] == [{"model": "no_qk_norm", "lr": 1e30, "step": 7}]
    (v,) = data["verdicts"]  # the diverged rate; attention grew 1 -> (inf dropped) 1
    assert v["index"] == 1 and v["gap"] is None and v["explained_by"] == "neither"
    assert "| 1.00e+30 | 2.100 | diverged |" in r.table()
    names = sorted(p.name for p in r.figures(tmp_path))
    assert names[0] == "lr_attn_logits_no_qk_norm.png" and len(names) == 5


def test_report_section_names_the_reduced_protocol(tmp_path, monkeypatch):
    r = _lr_result([2.0, 2.5], [[1.0, 20.0], [1.0, 30.0]])
    seen = []

    def fake(protocol, *a, **k):
        seen.append(protocol)
        return r

    monkeypatch.setattr(lr_sensitivity, "run_study", fake)
    text = lr_sensitivity.report_section(tmp_path, quick=False, full=False)
    assert seen == [lr_sensitivity.CPU]
    assert "Protocol `cpu`" in text and "blocklab report --full" in text
    assert "explained by **attention logits**" in text
    text = lr_sensitivity.report_section(tmp_path, full=True)
    assert seen[-1] is lr_sensitivity.FULL and "reduced protocol" not in text


def test_estimates_order_the_protocols():
    L = lr_sensitivity
    q, c, f = (L.estimate_seconds(p) for p in (L.QUICK, L.CPU, L.FULL))
    assert q < c < 600 < 3600 < f
