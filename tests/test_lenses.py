"""The logit and Jacobian lenses (`blocklab.interp.lenses`, issue 32 item 4).

References, each built independently of the code under test:

- the model's own logits (the last layer of either lens must give them);
- a NumPy readout (RMSNorm with its gain, the head, log-softmax, KL, softmax
  at the target, `np.argsort`) of the residual streams that `capture` reads;
- a dense `jax.jacfwd` of the map h_l (all positions) -> h_{L-1} (all
  positions), the later blocks run by hand with `model.stack.block(i)`, whose
  diagonal (t, t) blocks averaged over positions and sequences are J_l.
"""

import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab.interp import capture
from blocklab.interp.lenses import (
    jacobian_lens,
    jacobians,
    load_lens,
    logit_lens,
    save_lens,
)
from blocklab.models.decoder_config import DecoderConfig

SITE = "blocks.*.hook_resid_post"
VOCAB, D, L, T = 40, 16, 3, 5


def _perturb_final_norm(model, key):
    """A final-norm gain away from ones, so that a readout ignoring it is seen."""
    w = 1.0 + 0.3 * jax.random.normal(key, model.norm.weight.shape)
    return eqx.tree_at(lambda m: m.norm.weight, model, w)


@pytest.fixture(scope="module")
def llama():
    cfg = DecoderConfig.llama(VOCAB, D, 4, L, num_kv_heads=2, max_len=16)
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    return _perturb_final_norm(model, jax.random.key(7))


@pytest.fixture(scope="module")
def ids():
    return jax.random.randint(jax.random.key(1), (2, T), 0, VOCAB)


@pytest.fixture(scope="module")
def resid(llama, ids):
    """(L, 2, T, d) residual streams and the (2, T, V) logits, by `capture`."""
    logits, values = capture(llama, ids, SITE)
    return np.asarray(values[SITE], np.float64), np.asarray(logits, np.float64)


def _np_readout(model, h):
    """logits = (h / rms(h) * gain) W^T in float64 (Llama: no soft-cap, c = 1)."""
    w = np.asarray(model.norm.weight, np.float64)
    rms = np.sqrt(np.mean(h**2, axis=-1, keepdims=True) + model.norm.eps)
    return (h / rms * w) @ np.asarray(model.head_weight, np.float64).T


def _np_log_softmax(z):
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------- logit lens


@pytest.mark.parametrize("family", ["llama", "softcap"])
def test_logit_lens_last_layer_is_the_models_logits(family, request):
    """z_{L-1} = the model's logits; Gemma 3 with a final soft-cap adds the
    embedding scale, the unit-offset norm and the tied head."""
    if family == "llama":
        model = request.getfixturevalue("llama")
    else:
        cfg = DecoderConfig.gemma3(
            VOCAB, D, 4, 2, num_kv_heads=2, max_len=16, final_softcap=0.3
        )  # small: the cap moves these logits (max |z| 0.26 uncapped, 0.21 capped)
        model = bl.DecoderLM(cfg, key=jax.random.key(3))
        model = _perturb_final_norm(model, jax.random.key(9))
    cfg = model.cfg
    x = jax.random.randint(jax.random.key(4), (2, T), 0, VOCAB)
    res = logit_lens(model, x, k=4, target=x, logits=True)
    want = np.asarray(jax.jit(lambda m, x: m(x))(model, x))
    assert res.logits.shape == (cfg.num_blks, 2, T, VOCAB)
    np.testing.assert_allclose(np.asarray(res.logits[-1]), want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(res.kl[-1]), 0.0, atol=1e-6)


def test_logit_lens_matches_numpy(llama, ids, resid):
    """Every layer: top-k (argsort), their probabilities, target probability and
    KL(p_final || p_l), against a float64 NumPy readout of the captured streams."""
    h, final = resid
    target = jnp.roll(ids, -1, axis=-1)
    k = 4
    res = logit_lens(llama, ids, k=k, target=target, logits=True)
    assert res.top_k.shape == (L, 2, T, k) and res.kl.shape == (L, 2, T)
    assert res.top_k.dtype == jnp.int32 and res.kl.dtype == jnp.float32
    z = _np_readout(llama, h)  # (L, 2, T, V)
    np.testing.assert_allclose(np.asarray(res.logits), z, rtol=1e-4, atol=1e-4)
    logp, logp_final = _np_log_softmax(z), _np_log_softmax(final)
    kl = np.sum(np.exp(logp_final) * (logp_final - logp), axis=-1)
    assert kl[:-1].min() > 1e-3  # a test that can fail: earlier layers differ
    np.testing.assert_allclose(np.asarray(res.kl), kl, rtol=1e-3, atol=1e-5)
    # top-k: the k largest of the lens's own logits, in order
    order = np.argsort(-np.asarray(res.logits), axis=-1, kind="stable")[..., :k]
    np.testing.assert_array_equal(np.asarray(res.top_k), order)
    probs = np.take_along_axis(np.exp(logp), order, axis=-1)
    np.testing.assert_allclose(np.asarray(res.top_k_probs), probs, rtol=1e-4)
    tgt = np.take_along_axis(np.exp(logp), np.asarray(target)[None, ..., None], -1)
    np.testing.assert_allclose(np.asarray(res.target_probs), tgt[..., 0], rtol=1e-4)
    # without target / logits those fields stay empty
    plain = logit_lens(llama, ids, k=k)
    assert plain.target_probs is None and plain.logits is None
    np.testing.assert_array_equal(np.asarray(plain.top_k), np.asarray(res.top_k))


# ------------------------------------------------------------- Jacobians


def _hand_run(model, x, lo, hi):
    """Blocks lo..hi-1 applied one by one to a (T, d) stream (causal, RoPE)."""
    n = x.shape[0]
    for i in range(lo, hi):
        x = model.stack.block(i)(x, jnp.arange(1, n + 1), positions=jnp.arange(n))
    return x


@pytest.fixture(scope="module")
def dense(llama, ids):
    """The hand-run streams h_l `(L, B, T, d)` and the dense `jax.jacfwd` of
    h_l (T, d) -> h_{L-1} (T, d) per layer and sequence, `(L, B, T, d, T, d)`."""

    def streams_of(seq):
        h = llama.token_emb.weight[seq]  # Llama: no embedding scale
        out = []
        for i in range(L):
            h = _hand_run(llama, h, i, i + 1)
            out.append(h)
        return jnp.stack(out)

    streams = jax.jit(jax.vmap(streams_of))(ids)  # (B, L, T, d)
    full = []
    for layer in range(L):

        def tail(x, lo=layer + 1):
            return _hand_run(llama, x, lo, L)

        full.append(jax.jit(jax.vmap(jax.jacfwd(tail)))(streams[:, layer]))
    return np.swapaxes(np.asarray(streams), 0, 1), np.stack(full).astype(np.float64)


def _diagonal_mean(full, positions):
    """mean over sequences and `positions` t of the (t, t) blocks: `(L, d, d)`."""
    blocks = [full[:, :, t, :, t, :] for t in positions]  # each (L, B, d, d)
    return np.mean(np.stack(blocks), axis=(0, 2))


@pytest.fixture(scope="module")
def jac_reverse(llama, ids):
    return jacobians(llama, ids)


def test_hand_run_matches_capture(resid, dense):
    """The dense reference runs the same model: its streams are capture's."""
    np.testing.assert_allclose(dense[0], resid[0], rtol=1e-5, atol=1e-5)


def test_jacobians_reverse_equal_dense_jacfwd(jac_reverse, dense):
    want = _diagonal_mean(dense[1], range(T))
    assert jac_reverse.shape == (L, D, D) and jac_reverse.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(jac_reverse[-1]), np.eye(D))
    assert np.abs(want[:-1] - np.eye(D)).max() > 0.05  # not trivially I
    np.testing.assert_allclose(np.asarray(jac_reverse), want, rtol=1e-4, atol=1e-5)


def test_jacobians_forward_equal_dense_jacfwd(llama, ids, dense):
    """Forward mode, some positions (one negative), a chunk that does not
    divide the L * P * d products."""
    got = jacobians(llama, ids, positions=[1, -1], mode="forward", chunk=7)
    want = _diagonal_mean(dense[1], [1, T - 1])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_jacobian_lens_reads_J_h(llama, ids, resid, jac_reverse):
    """z_l = U(J_l h_l) (rows of J index the last layer); at the last layer
    J = I and the lens is the logit lens."""
    h, _ = resid
    res = jacobian_lens(llama, ids, jac_reverse, k=3, logits=True)
    plain = logit_lens(llama, ids, k=3, logits=True)
    np.testing.assert_array_equal(np.asarray(res.logits[-1]), plain.logits[-1])
    np.testing.assert_array_equal(np.asarray(res.top_k[-1]), plain.top_k[-1])
    moved = np.einsum("lij,lbtj->lbti", np.asarray(jac_reverse, np.float64), h)
    want = _np_readout(llama, moved)
    np.testing.assert_allclose(np.asarray(res.logits), want, rtol=1e-4, atol=1e-4)
    assert np.abs(want[0] - plain.logits[0]).max() > 1e-2  # J_0 changes layer 0


# ------------------------------------------------------------ save / load


def test_save_load_round_trip(llama, jac_reverse, tmp_path):
    path = save_lens(
        tmp_path / "lens.safetensors", jac_reverse, model=llama,
        metadata={"corpus": "random ids", "tokens": 10},
    )  # fmt: skip
    jac, meta = load_lens(path, model=llama)
    np.testing.assert_array_equal(np.asarray(jac), np.asarray(jac_reverse))
    assert meta["num_layers"] == str(L) and meta["num_hiddens"] == str(D)
    assert meta["model"] == "DecoderLM" and meta["corpus"] == "random ids"
    assert json.loads(meta["tokens"]) == 10
    assert json.loads(meta["config"])["cfg"]["block"]["num_hiddens"] == D
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lens.safetensors"]


def test_load_refuses_another_width(llama, tmp_path):
    path = save_lens(tmp_path / "l.safetensors", np.zeros((L, 8, 8), np.float32))
    with pytest.raises(bl.ConfigError, match=r"width d=8.*DecoderLM.*width d=16"):
        load_lens(path, model=llama)
    from safetensors.numpy import save_file

    other = tmp_path / "other.safetensors"
    save_file({"w": np.zeros(3, np.float32)}, str(other))
    with pytest.raises(bl.ConfigError, match="not a Jacobian lens"):
        load_lens(other)
    with pytest.raises(bl.ConfigError, match=r"\(L, d, d\) = \(3, 16, 16\)"):
        save_lens(tmp_path / "x.safetensors", np.zeros((2, D, D)), model=llama)
    with pytest.raises(bl.ConfigError, match="reserved"):
        save_lens(
            tmp_path / "x.safetensors", np.zeros((L, D, D)), metadata={"format": 1}
        )


# -------------------------------------------------------------- refusals


def test_refusals(llama, ids, plain_python):
    stack = llama.stack
    stream = jnp.zeros((T, D))
    for model in (stack, stack.block(0)):
        with pytest.raises(
            bl.ConfigError, match=rf"{type(model).__name__} has no unembedding"
        ):
            logit_lens(model, stream)
        with pytest.raises(bl.ConfigError, match="has no unembedding"):
            jacobian_lens(model, stream, jnp.zeros((L, D, D)))
    with pytest.raises(
        bl.ConfigError, match=r"jac must have shape.*\(3, 16, 16\).*\(3, 8, 8\)"
    ):
        jacobian_lens(llama, ids, jnp.zeros((L, 8, 8)))
    with pytest.raises(
        bl.ConfigError,
        match=r"mode must be one of \['reverse', 'forward'\], got 'sideways'",
    ):
        jacobians(llama, ids, mode="sideways")
    with pytest.raises(
        bl.ConfigError, match=r"positions must lie in \[-T, T\) for T=5"
    ):
        jacobians(llama, ids, positions=[5])
    fused = bl.with_attention_impl(llama, "chunked")
    with pytest.raises(bl.ConfigError, match="mode='forward' needs forward-mode"):
        jacobians(fused, ids, mode="forward")
    with pytest.raises(bl.ConfigError, match="chunk"):
        jacobians(llama, ids, chunk=0)
    with pytest.raises(
        bl.ConfigError,
        match=r"target must be integer token ids of the inputs' shape \(2, 5\)",
    ):
        logit_lens(llama, ids, target=ids[0])
    with pytest.raises(
        bl.ConfigError, match=r"target ids must lie in \[0, vocab_size=40\)"
    ):
        logit_lens(llama, ids, target=ids + VOCAB)
    with pytest.raises(bl.ConfigError, match="k must be at most vocab_size=40"):
        logit_lens(llama, ids, k=VOCAB + 1)


def test_a_charlm_has_lenses_too():
    """`CharLM.logits` (tied head, μP readout multiplier): its logit lens at the
    last layer is the model's output, and its Jacobian lens with J = I there."""
    model = bl.CharLM(28, 16, 2, 2, max_len=16, parametrization="mup", base_width=8,
                      key=jax.random.key(5))  # fmt: skip
    toks = jnp.arange(9) % 28
    lens = logit_lens(model, toks, logits=True)
    np.testing.assert_allclose(lens.logits[-1], model(toks), rtol=1e-6, atol=1e-6)
    assert float(np.abs(lens.kl[-1]).max()) < 1e-6
    assert float(lens.kl[0].max()) > 0
