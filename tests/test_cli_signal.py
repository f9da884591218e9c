"""`blocklab signal`: strict JSON against a NumPy float64 stack, figures, validation.

The reference rebuilds the stack of seed 0 from the documented key contract
of `signal_run` (split `key(0)` into stack, input and readout keys) and runs
it block by block with the independent float64 block of `tests/reference.py`.
"""

import contextlib
import io
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref
from strict_json import strict_loads

from blocklab import state_dict
from blocklab.cli import main
from blocklab.diagnostics import propagation as sg
from blocklab.experiments import signal as study

N, D, H = 2, 16, 4
ARGS = ["signal", "--blocks", str(N), "--num-seeds", "1", "--num-hiddens", str(D)]


def run_json(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        status = main([*argv, "--json"])
    return status, strict_loads(buf.getvalue())


@pytest.fixture(scope="module")
def json_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("signal")
    argv = [*ARGS, "--placements", "post", "pre", "--out", str(out),
            "--exercises", "4", "6c"]  # fmt: skip
    status, data = run_json(argv)
    assert status == 0
    return data, out


def reference_run(placement, *, ffn=True):
    """Seed 0 in float64: per block stream RMS, spread, entropy, max logit, mixed."""
    stack_key, x_key, _ = jax.random.split(jax.random.key(0), 3)
    stack = sg.chapter_stack(
        placement, num_blks=N, num_hiddens=D, num_heads=H, ffn=ffn, key=stack_key
    )
    X = np.asarray(jax.random.normal(x_key, (2, 64, D), jnp.float32), np.float64)
    rows = []
    h = X
    for k in range(N):
        sd = state_dict(stack.block(k))
        if not ffn:  # the zero FFN has no weights: a zero branch
            sd.update({"ffn.W_1.weight": np.zeros((1, D)),
                       "ffn.W_2.weight": np.zeros((D, 1))})  # fmt: skip
        eps = stack.block(k).norm1.eps
        entropies, logits_max, mixed = [], 0.0, []
        for seq in h:
            y = ref.norm(sd, "norm1", seq, "layer", eps) if placement == "pre" else seq
            out, weights, logits = ref.attention(sd, y, H)
            entropies.append(ref.entropy(weights).mean())
            logits_max = max(logits_max, np.abs(logits).max())
            mixed.append(out)
        h = np.stack([
            ref.block(sd, seq, H, norm_kind="layer", act="gelu",
                      placement=placement, eps=eps)
            for seq in h
        ])  # fmt: skip
        centred = h - h.mean(axis=-2, keepdims=True)
        rows.append(
            dict(
                stream_rms=math.sqrt(np.mean(h**2)),
                token_spread=np.linalg.norm(centred) / np.linalg.norm(h),
                attn_entropy=float(np.mean(entropies)),
                max_logit=logits_max,
            )
        )
    return rows, X, stack


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_json_matches_a_numpy_float64_stack(json_run, placement):
    data, _ = json_run
    got = data["placements"][placement]
    rows, _, _ = reference_run(placement)
    for field in ("stream_rms", "token_spread", "attn_entropy", "max_logit"):
        want = [r[field] for r in rows]
        np.testing.assert_allclose(got[field], want, rtol=2e-4, err_msg=field)


def test_post_ln_json_stream_rms_is_one(json_run):
    data, _ = json_run
    # LayerNorm with unit gain and zero shift: RMS sqrt(var / (var + eps)) ~ 1.
    np.testing.assert_allclose(data["placements"]["post"]["stream_rms"], 1.0, atol=1e-4)


def test_exercise_6c_logits_scale_as_lambda_squared(json_run):
    # q^T k is bilinear in (W_q, W_k): scaling both by lambda scales every logit,
    # hence their std, by exactly lambda^2; QK-norm divides the scale out.
    ex = json_run[0]["exercises"]["6c"]
    lam = np.asarray(ex["lambda"])
    np.testing.assert_array_equal(lam, [1, 2, 4, 8])
    plain = np.asarray(ex["logit_std_plain"])
    np.testing.assert_allclose(plain / plain[0], lam**2, rtol=1e-4)
    qk = np.asarray(ex["logit_std_qk"])
    np.testing.assert_allclose(qk / qk[0], 1.0, rtol=1e-3)
    assert ex["entropy_plain"][-1] < ex["entropy_plain"][0] < math.log(64) + 1e-6


def test_exercise_4_schema(json_run):
    ex4 = json_run[0]["exercises"]["4"]
    assert set(ex4) == {"budget", "measured", "c_attn", "c_ffn", "fits"}
    assert all(len(ex4[k]) == N for k in ("budget", "measured", "c_attn", "c_ffn"))
    assert set(ex4["fits"]) == {"1-2"}


def test_grad_w_o_matches_its_closed_form(tmp_path):
    # Pre-LN, one block, zero FFN: H = X + M W_o^T with M the mixed heads, so
    # d mean(R * H) / d W_o = R^T M / (B T d), whatever W_o is.
    status, data = run_json(["signal", "--blocks", "1", "--num-seeds", "1",
                             "--num-hiddens", str(D), "--placements", "pre",
                             "--no-ffn", "--out", str(tmp_path)])  # fmt: skip
    assert status == 0
    stack_key, x_key, r_key = jax.random.split(jax.random.key(0), 3)
    stack = sg.chapter_stack(
        "pre", num_blks=1, num_hiddens=D, num_heads=H, ffn=False, key=stack_key
    )
    X = np.asarray(jax.random.normal(x_key, (2, 64, D), jnp.float32), np.float64)
    R = np.asarray(jax.random.normal(r_key, (2, 64, D), jnp.float32), np.float64)
    sd = state_dict(stack.block(0))
    eps = stack.block(0).norm1.eps
    grad = np.zeros((D, D))
    for x, r in zip(X, R, strict=True):
        y = ref.norm(sd, "norm1", x, "layer", eps)
        q = ref.linear(sd, "attention.W_q", y)
        k = ref.linear(sd, "attention.W_k", y)
        v = ref.linear(sd, "attention.W_v", y)
        p = D // H
        mixed = np.concatenate(
            [ref.masked_softmax(q[:, i*p:(i+1)*p] @ k[:, i*p:(i+1)*p].T / math.sqrt(p))
             @ v[:, i*p:(i+1)*p] for i in range(H)], axis=-1,
        )  # fmt: skip
        grad += r.T @ mixed
    grad /= X.size
    got = data["placements"]["pre"]["grad_norms"]["W_o"][0]
    assert got == pytest.approx(np.linalg.norm(grad), rel=1e-4)


def test_overflow_is_reported_as_null_with_exit_status_0(tmp_path):
    status, data = run_json([*ARGS, "--placements", "pre", "--alpha", "1e20",
                             "--out", str(tmp_path)])  # fmt: skip
    assert status == 0
    assert data["nonfinite"] == ["pre"]
    assert None in data["placements"]["pre"]["stream_rms"]
    assert (tmp_path / "signal_rms.png").exists()  # plotting survives inf / NaN


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


@pytest.mark.slow
def test_table_lists_each_placement_with_the_chapter_columns(tmp_path, capsys):
    argv = ["signal", "--blocks", "4", "--num-seeds", "2", "--num-hiddens", "16",
            "--placements", "post", "pre", "--out", str(tmp_path)]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert (
        "| placement | stream RMS k=4 | spread k=1 | spread k=2 | spread k=4 |" in text
    )
    rows = [line for line in text.splitlines() if line.startswith(("| post", "| pre"))]
    assert len(rows) == 2 and all(line.count("[") == 8 for line in rows)


def test_checkpoints_are_the_chapters_blocks_at_depth_32():
    assert study.checkpoints(32) == [8, 16, 32]
    assert study.checkpoints(1) == [1]


@pytest.mark.parametrize(
    "bad, message",
    [
        (["--num-seeds", "0"], "--num-seeds must lie in [1, inf], got 0"),
        (["--num-seeds", "-2"], "--num-seeds must lie in [1, inf], got -2"),
        (["--blocks", "0"], "--blocks must lie in [1, inf], got 0"),
        (["--alpha", "-1"], "--alpha must be a finite scale > 0"),
        (["--alpha", "inf"], "--alpha must be a finite scale > 0"),
        (["--num-hiddens", "18"], "multiple of the 4 heads"),
        (["--placements", "pre", "pre"], "--placements must be distinct"),
    ],
)
def test_bad_values_are_refused_before_any_work(bad, message, monkeypatch):
    monkeypatch.setattr(study, "signal_propagation", lambda *a, **k: 1 / 0)
    status, data = run_json(["signal", *bad])
    assert status == 2 and message in data["error"]


def test_an_output_folder_that_is_a_file_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "signal_propagation", lambda *a, **k: 1 / 0)
    f = tmp_path / "a_file"
    f.write_text("x")
    status, data = run_json(["signal", "--out", str(f)])
    assert status == 2 and "--out" in data["error"]


def test_unknown_placement_is_rejected(capsys):
    assert main(["signal", "--placements", "middle"]) == 2
    assert "invalid choice: 'middle'" in capsys.readouterr().err


@pytest.mark.slow
def test_report_section_links_its_figures(tmp_path):
    section = study.report_section(tmp_path, quick=True)
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


@pytest.mark.slow
def test_arch_runs_on_a_real_architectures_stack(tmp_path):
    # OLMo 2 at initialization: the stack's attention is bounded by its QK-norm,
    # so the entropy stays within log 64 and above zero; every value is finite.
    status, data = run_json(["signal", "--arch", "olmo2", "--blocks", "2",
                             "--num-seeds", "1", "--num-hiddens", "16",
                             "--out", str(tmp_path)])  # fmt: skip
    assert status == 0 and data["options"]["arch"] == "olmo2"
    got = data["placements"]["olmo2"]
    assert data["nonfinite"] == [] and len(got["stream_rms"]) == 2
    assert all(0.0 < e <= math.log(64) + 1e-6 for e in got["attn_entropy"])


def test_arch_refuses_chapter_only_options(monkeypatch):
    monkeypatch.setattr(study, "signal_arch", lambda *a, **k: 1 / 0)
    status, data = run_json(["signal", "--arch", "llama", "--qk-norm"])
    assert status == 2 and "--arch measures the preset" in data["error"]
