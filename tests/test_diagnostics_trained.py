"""`blocklab.diagnostics.trained.model_diagnostics`: the chapter's diagnostics on
any model, against NumPy from the captured sites, the at-init `signal_stats`,
closed forms and gradients taken by hand on the unstacked blocks."""

import functools
import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError, interp
from blocklab.diagnostics import model_diagnostics
from blocklab.diagnostics import propagation as sg
from blocklab.models.decoder_config import DecoderConfig
from blocklab.training.losses import lm_loss

V, B, T, W = 40, 2, 10, 4


@functools.cache
def _model(name):
    key = jax.random.key(0)
    if name == "llama":  # grouped-query attention, RoPE, untied head
        return bl.DecoderLM(DecoderConfig.llama(V, 32, 4, 2, num_kv_heads=2), key=key)
    if name == "gemma3":  # sandwich norms, QK-norm, layer 0 local (window W)
        cfg = DecoderConfig.gemma3(V, 32, 4, 2, window=W, global_every=2)
        return bl.DecoderLM(cfg, key=key)
    if name == "charlm":
        return bl.CharLM(V, 16, 2, 2, max_len=16, key=key)
    raise AssertionError(name)


def _windows(name, L):
    """The window of each layer (0: global), from the configs written above."""
    return [W, 0] if name == "gemma3" else [0] * L


def _ids(seed=1):
    return jax.random.randint(jax.random.key(seed), (B, T), 0, V)


def _visible(T, w):
    """Causal (windowed) mask by hand: query q sees keys q - w < k <= q."""
    q, k = np.arange(T)[:, None], np.arange(T)[None, :]
    vis = k <= q
    return vis & (k > q - w) if w else vis


@pytest.mark.parametrize("name", ["llama", "gemma3", "charlm"])
def test_entropy_and_spread_equal_numpy_on_the_captured_sites(name):
    model, ids = _model(name), _ids()
    diag = model_diagnostics(model, ids)
    _, sites = interp.capture(
        model, ids, ["blocks.*.attn.hook_pattern", "blocks.*.hook_resid_post"]
    )
    P = np.asarray(sites["blocks.*.attn.hook_pattern"], np.float64)  # L B H T T
    Hs = np.asarray(sites["blocks.*.hook_resid_post"], np.float64)  # L B T d
    L, _, nh = P.shape[:3]
    assert diag["attn_entropy"].shape == (L, nh)
    for layer, w in enumerate(_windows(name, L)):
        vis = _visible(T, w)
        for h in range(nh):
            rows = []
            for b in range(B):
                for q in range(T):
                    p = P[layer, b, h, q][vis[q]]
                    rows.append(-np.sum(p * np.log(p)))
            np.testing.assert_allclose(
                diag["attn_entropy"][layer, h], np.mean(rows), rtol=2e-5
            )
        uniform = np.mean([math.log(vis[q].sum()) for q in range(T)])
        np.testing.assert_allclose(
            diag["attn_entropy_uniform"][layer], uniform, rtol=1e-6
        )
        assert np.all(np.asarray(diag["attn_entropy"][layer]) <= uniform + 1e-5)
        Hl = Hs[layer]
        centred = Hl - Hl.mean(axis=1, keepdims=True)  # mean token per sequence
        spread = np.sqrt(np.sum(centred**2) / np.sum(Hl**2))
        np.testing.assert_allclose(diag["token_spread"][layer], spread, rtol=1e-5)
        np.testing.assert_allclose(
            diag["stream_rms"][layer], np.sqrt(np.mean(Hl**2)), rtol=1e-5
        )


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_zero_queries_give_uniform_attention_entropy_log_visible_keys(name):
    # W_q = 0: every score is 0 (RoPE and QK-norm keep a zero query zero), so
    # the pattern is uniform over the visible keys and each row's entropy is
    # log(number of visible keys): log(q + 1), or log(min(q + 1, w)) locally.
    model = _model(name)
    model = eqx.tree_at(
        lambda m: m.stack.blocks.attention.W_q.weight,
        model,
        replace_fn=jnp.zeros_like,
    )
    diag = model_diagnostics(model, _ids())
    L = diag["attn_entropy"].shape[0]
    for layer, w in enumerate(_windows(name, L)):
        n = [min(q + 1, w) if w else q + 1 for q in range(T)]
        expected = sum(math.log(k) for k in n) / T
        np.testing.assert_allclose(diag["attn_entropy"][layer], expected, rtol=1e-6)
        np.testing.assert_allclose(
            diag["attn_entropy_uniform"][layer], expected, rtol=1e-6
        )


def test_a_chapter_stack_gives_the_numbers_of_signal_stats():
    # Two paths to the same numbers: the named sites and the parameter
    # gradient here, TransformerBlock.trace and the scan's collect there.
    stack = sg.chapter_stack(
        "pre", num_blks=3, num_hiddens=16, num_heads=2, key=jax.random.key(0)
    )
    X = jax.random.normal(jax.random.key(3), (B, 8, 16))
    diag = model_diagnostics(stack, X)
    ref = sg.signal_stats(stack, X)  # the same default readout, key(0)
    forward_only = model_diagnostics(stack, X, grads=False)
    assert sorted(forward_only) == sorted(
        set(diag) - {"loss", "grad_norm", "grad_norms"}
    )
    np.testing.assert_allclose(
        diag["attn_entropy"].mean(axis=1), ref.attn_entropy, rtol=1e-5
    )
    # no mask: every query sees all 8 keys
    np.testing.assert_allclose(diag["attn_entropy_uniform"], math.log(8), rtol=1e-6)
    np.testing.assert_allclose(diag["token_spread"], ref.token_spread, rtol=1e-5)
    np.testing.assert_allclose(diag["stream_rms"], ref.stream_rms, rtol=1e-5)
    for name in sg.PROJECTIONS:
        np.testing.assert_allclose(
            diag["grad_norms"][f"attention.{name}.weight"],
            ref.grad_norms[name],
            rtol=1e-4,
        )


def _hand_loss(blocks, rest, ids):
    """Llama's forward written out over a list of ordinary blocks, and the
    mean next-token cross-entropy of positions 0..T-2 (NumPy-free of the
    scan, the hooks and lm_loss)."""
    T = ids.shape[-1]
    h = rest.token_emb.weight[ids]
    lens = jnp.arange(1, T + 1)[None, :]  # causal: query q sees keys 0..q
    for blk in blocks:
        h = blk(h, lens, positions=jnp.arange(T))
    logits = rest.norm(h) @ rest.head.weight.T
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    return -jnp.mean(jnp.take_along_axis(logp, ids[:, 1:, None], axis=-1))


def test_block_gradient_norms_equal_jax_grad_on_the_unstacked_blocks():
    model, ids = _model("llama"), _ids()
    diag = model_diagnostics(model, ids)
    blocks = list(model.stack.unstack())
    # the default loss: position t predicts token t + 1 (the hand loss's maths)
    value, grads = eqx.filter_jit(eqx.filter_value_and_grad(_hand_loss))(
        blocks, model, ids
    )
    np.testing.assert_allclose(diag["loss"], value, rtol=1e-5)
    for layer, g in enumerate(grads):
        leaves = [np.asarray(x, np.float64) for x in jax.tree_util.tree_leaves(g)]
        total = np.sqrt(sum(np.sum(x**2) for x in leaves))
        np.testing.assert_allclose(diag["grad_norm"][layer], total, rtol=1e-4)
        for path in ("attention.W_q.weight", "ffn.W_g.weight", "norm2.weight"):
            leaf = functools.reduce(getattr, path.split("."), g)
            np.testing.assert_allclose(
                diag["grad_norms"][path][layer],
                np.linalg.norm(np.asarray(leaf, np.float64)),
                rtol=1e-4,
            )


def test_targets_give_the_lm_loss_of_those_targets():
    model, ids = _model("llama"), _ids()
    Y = (ids * 3 + 1) % V
    diag = model_diagnostics(model, ids, targets=Y)
    np.testing.assert_allclose(diag["loss"], lm_loss(model, ids, Y), rtol=1e-5)


@pytest.mark.slow  # kept out of the default run for CI time
def test_sweep_probe_records_the_diagnostics_of_every_member():
    data = bl.TimeMachine(seq_len=8, num_train=200, num_val=8)
    ids = _ids()  # a fixed batch (ids < V; the corpus' 28 characters too)

    def make_model(key):  # the structure of _model("charlm")
        return bl.CharLM(V, 16, 2, 2, max_len=16, key=key)

    res = bl.train_sweep(
        make_model,
        data,
        4,
        model_keys=[0, 1],
        data_keys=[5, 6],
        run=bl.RunConfig(batch_size=4, steps_per_call=2, progress=False),
        sweep=bl.SweepConfig(
            learning_rates=[1e-2, 3e-2],
            probe=lambda m: model_diagnostics(m, ids),
            validate=False,
        ),
    )
    np.testing.assert_array_equal(res.probe_steps, [0, 2, 4])
    assert res.probes["attn_entropy"].shape == (2, 3, 2, 2)  # K, evals, L, H
    for k, seed in enumerate([0, 1]):
        for r, model in ((0, make_model(jax.random.key(seed))), (-1, res.model(k))):
            alone = model_diagnostics(model, ids)
            got = jax.tree_util.tree_map(lambda a, k=k, r=r: a[k, r], res.probes)
            jax.tree_util.tree_map(
                functools.partial(np.testing.assert_allclose, rtol=1e-4, atol=1e-7),
                got,
                alone,
            )
    # training moved the weights: the final diagnostics differ from step 0
    assert not np.allclose(
        res.probes["grad_norm"][:, 0], res.probes["grad_norm"][:, -1]
    )


def test_bad_arguments_are_refused_by_name(plain_python):
    stack = sg.chapter_stack(
        "pre", num_blks=1, num_hiddens=8, num_heads=2, key=jax.random.key(0)
    )
    X = jnp.zeros((4, 8))
    with pytest.raises(ConfigError, match="DecoderLM, a CharLM or a Stack"):
        model_diagnostics(stack.block(0), X)
    with pytest.raises(ConfigError, match="targets"):
        model_diagnostics(stack, X, targets=jnp.zeros(4, jnp.int32))
    model, ids = _model("llama"), _ids()
    with pytest.raises(ConfigError, match=r"shape of inputs \(2, 10\)"):
        model_diagnostics(model, ids, targets=ids[:, 1:])
    with pytest.raises(ConfigError, match="not both"):
        model_diagnostics(model, ids, targets=ids, loss=jnp.sum)
    with pytest.raises(ConfigError, match="at least 2 tokens"):
        model_diagnostics(model, ids[:, :1])
    with pytest.raises(ConfigError, match="loss must be a function"):
        model_diagnostics(model, ids, loss=3.0)
