"""Looking inside models (`blocklab.interp`, issue 32): capture, patching,
ablation, steering and attribution, each against an independent reference
(the unpatched run, a run of the other input, the later blocks called by
hand, a NumPy attention, finite differences, NumPy formulas), and bad
requests refused by name."""

import functools

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from decoding import sharpen

import blocklab as bl
from blocklab import CharLM, DecoderConfig, DecoderLM, Stack, TransformerBlock
from blocklab.interp import (
    ablate_heads,
    ablate_neurons,
    attribute,
    capture,
    intervene,
    patch,
    steer,
)
from blocklab.models import MoEDecoderConfig
from blocklab.nn.functional import causal_lengths

V, D, H, KV, T, L = 29, 32, 4, 2, 8, 3
P, G = D // H, H // KV
CAUSAL = jnp.arange(1, T + 1)
EPS = 1e-6  # BlockConfig's default norm_eps


@functools.cache
def _lm(x64):
    cfg = DecoderConfig.llama(V, D, H, L, num_kv_heads=KV, max_len=12)
    return sharpen(DecoderLM(cfg, key=jax.random.key(0)), 1)


def lm():
    """A Llama-style DecoderLM (RoPE, grouped-query, SwiGLU, 3 layers), built
    once per run and precision."""
    return _lm(jax.config.jax_enable_x64)


def ids_of(seed):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, T), jnp.int32)


def stream(seed=2):
    return jax.random.normal(jax.random.key(seed), (T, D))


def block_of(placement="pre", *, key=None, **options):
    key = jax.random.key(1) if key is None else key
    return TransformerBlock(
        D, H, placement=placement, num_kv_heads=KV, key=key, **options
    )


@functools.cache
def _stack(x64, n):
    return Stack(lambda k: block_of(key=k), n, key=jax.random.key(3))


def stack_of(n=2):
    """A `Stack` of n pre-norm grouped-query blocks (no RoPE), built once."""
    return _stack(jax.config.jax_enable_x64, n)


def softmax(s):
    e = np.exp(s - s.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


# ---------------------------------------------------------------- identities

BLOCK_SITES = [
    "hook_resid_pre",
    "hook_resid_mid",
    "attn.hook_q",
    "attn.hook_pattern",
    "attn.hook_z",
    "mlp.hook_post",
    "ln1.hook_normalized",
    "hook_resid_post",
]


@pytest.mark.parametrize("placement", ["pre", "post", "output", "sandwich"])
def test_patching_a_site_with_its_own_value_changes_nothing(placement):
    """Each site patched alone with the value it had: the output is bit for
    bit the hooked run's (and the plain block's)."""
    blk, x = block_of(placement, rope_theta=1e4), stream()
    out, values = capture(blk, x, BLOCK_SITES, mask=CAUSAL)
    np.testing.assert_array_equal(out, blk(x, CAUSAL))
    for site, value in values.items():
        patched = intervene(blk, x, {site: patch(value)}, mask=CAUSAL)
        np.testing.assert_array_equal(patched, out, err_msg=site)


def test_patching_stacked_sites_with_their_own_values_changes_nothing():
    """The same in the scanned stack: a value stacked over layers is read at
    each edit's layer (a patch from the wrong layer would change the logits)."""
    model, ids = lm(), ids_of(0)
    site = "blocks.*.attn.hook_pattern"
    out, values = capture(model, ids, [site, "blocks.*.hook_resid_post"])
    np.testing.assert_array_equal(out, model(ids))
    assert values[site].shape == (L, H, T, T)
    patched = intervene(model, ids, {site: patch(values[site])})
    np.testing.assert_array_equal(patched, out)
    # one layer, read from the stacked value
    source = values["blocks.*.hook_resid_post"]
    patched = intervene(model, ids, {"blocks.1.hook_resid_post": patch(source)})
    np.testing.assert_array_equal(patched, out)


def test_patching_the_residual_stream_from_another_run():
    """All of layer 1's `hook_resid_post` from run B: every row of the logits
    is B's. Layer 1's `hook_resid_pre` from B: its `hook_resid_post` is B's."""
    model, a, b = lm(), ids_of(0), ids_of(1)
    sites = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"]
    zb, vb = capture(model, b, sites)
    za = model(a)
    assert np.abs(za - zb).max() > 1.0  # the runs differ
    z = intervene(model, a, {"blocks.1.hook_resid_post": patch(vb[sites[1]])})
    np.testing.assert_allclose(z, zb, rtol=0, atol=1e-6 * np.abs(zb).max())
    _, v = capture(
        model, a, "blocks.1.hook_resid_post",
        edits={"blocks.1.hook_resid_pre": patch(vb[sites[0]])},
    )  # fmt: skip
    want = vb[sites[1]][1]
    np.testing.assert_allclose(
        v["blocks.1.hook_resid_post"], want, rtol=0, atol=1e-6 * np.abs(want).max()
    )


def test_a_zero_steering_vector_is_the_identity():
    model, ids = lm(), ids_of(0)
    zero = intervene(model, ids, {"blocks.*.hook_resid_post": steer(jnp.zeros(D))})
    np.testing.assert_array_equal(zero, model(ids))


@pytest.mark.parametrize(
    "no_heads",
    [
        np.array([], np.int32),
        [],  # read as float32 by jnp.asarray: made integer
    ],
)
def test_ablating_no_heads_is_the_identity(no_heads):
    model, ids = lm(), ids_of(0)
    none = intervene(model, ids, {"blocks.*.attn.hook_z": ablate_heads(no_heads)})
    np.testing.assert_array_equal(none, model(ids))


def test_steering_equals_the_later_blocks_run_by_hand():
    """$h_0 \\leftarrow h_0 + c v$ at layer 0's `hook_resid_post`: the logits
    of blocks 1 and 2 called one by one on it, then the final norm and head;
    the same with `layers=[0]` on the pattern of every layer."""
    model, ids = lm(), ids_of(0)
    v, c = jax.random.normal(jax.random.key(5), (D,)), 1.5
    _, vals = capture(model, ids, "blocks.0.hook_resid_post")
    h = vals["blocks.0.hook_resid_post"] + c * v
    for i in range(1, L):
        h = model.stack.block(i)(h, causal_lengths((T,)), positions=jnp.arange(T))
    want = np.asarray(model.logits(model.norm(h)))
    assert np.abs(want - model(ids)).max() > 0.1  # the steer matters
    tol = dict(rtol=0, atol=2e-5 * np.abs(want).max())
    got = intervene(model, ids, {"blocks.0.hook_resid_post": steer(v, scale=c)})
    np.testing.assert_allclose(got, want, **tol)
    got = intervene(
        model, ids, {"blocks.*.hook_resid_post": steer(v, scale=c, layers=[0])}
    )
    np.testing.assert_allclose(got, want, **tol)


# ------------------------------------------------------------------ ablation


def numpy_attention(blk, x, drop=()):
    """The pre-norm block's attention output for stream `x` (T, D), in
    float64 NumPy, without the heads `drop` (their columns of $W_O$)."""
    attn = blk.attention
    x = np.asarray(x, np.float64)
    xn = x / np.sqrt(np.mean(x**2, -1, keepdims=True) + EPS)
    xn = xn * np.asarray(blk.norm1.weight)
    q = (xn @ np.asarray(attn.W_q.weight).T).reshape(T, H, P)
    k = (xn @ np.asarray(attn.W_k.weight).T).reshape(T, KV, P)
    v = (xn @ np.asarray(attn.W_v.weight).T).reshape(T, KV, P)
    w_o = np.asarray(attn.W_o.weight)  # (D, H P)
    out = np.zeros((T, D))
    for i in range(H):
        if i in drop:
            continue
        s = q[:, i] @ k[:, i // G].T / np.sqrt(P)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        out += (softmax(s) @ v[:, i // G]) @ w_o[:, i * P : (i + 1) * P].T
    return out


def test_head_ablation_equals_attention_without_the_heads_rows_of_W_O():
    """Zeroing head 2 of layer 1's `attn.hook_z` in a `Stack`: its
    `hook_attn_out` is a NumPy attention without head 2's slice of $W_O$,
    and the output that plus the FFN called by hand."""
    stack = stack_of()
    x = stream()
    sites = ["blocks.1.hook_attn_out", "blocks.1.hook_resid_mid"]
    out, vals = capture(
        stack, x, sites, edits={"blocks.1.attn.hook_z": ablate_heads(2)},
        mask=CAUSAL,
    )  # fmt: skip
    blk1 = stack.block(1)
    h1 = np.asarray(stack.block(0)(x, CAUSAL), np.float64)
    want = numpy_attention(blk1, h1, drop=(2,))
    full = numpy_attention(blk1, h1)
    assert np.abs(want - full).max() > 1e-2  # head 2 wrote something
    np.testing.assert_allclose(vals[sites[0]], want, rtol=0, atol=1e-5)
    np.testing.assert_allclose(vals[sites[1]], h1 + want, rtol=0, atol=1e-5)
    mid = jnp.asarray(h1 + want, jnp.float32)
    np.testing.assert_allclose(out, mid + blk1.ffn(blk1.norm2(mid)), rtol=0, atol=1e-5)


def test_mean_ablation_of_neurons_uses_the_mean_over_positions():
    stack = stack_of()
    x, neurons = stream(), [2, 5]
    sites = ["blocks.0.mlp.hook_post", "blocks.0.hook_mlp_out"]
    _, base = capture(stack, x, sites[0], mask=CAUSAL)
    _, vals = capture(
        stack, x, sites, edits={sites[0]: ablate_neurons(neurons, mode="mean")},
        mask=CAUSAL,
    )  # fmt: skip
    want = np.array(base[sites[0]], np.float64)
    want[:, neurons] = want[:, neurons].mean(axis=0)
    np.testing.assert_allclose(vals[sites[0]], want, rtol=0, atol=1e-6)
    w_2 = np.asarray(stack.block(0).ffn.W_2.weight)
    np.testing.assert_allclose(vals[sites[1]], want @ w_2.T, rtol=0, atol=1e-5)


# --------------------------------------------------------------- attribution


def test_attribution_agrees_with_finite_differences():
    r"""For random unit directions $u$ over the sites:
    $(m(a + \epsilon u) - m(a - \epsilon u)) / 2\epsilon \approx \langle g, u\rangle$,
    with $m$ a logit difference and $g$ `attribute`'s gradient."""
    model, ids = lm(), ids_of(0)
    sites = ["hook_embed", "blocks.*.hook_resid_mid"]

    def metric(z):
        return z[-1, 3] - z[-1, 7]

    value, vals, grads = attribute(model, ids, sites, metric)
    np.testing.assert_allclose(value, metric(model(ids)), rtol=1e-6)
    assert set(vals) == set(grads) == set(sites)
    for s in sites:
        assert grads[s].shape == vals[s].shape

    @jax.jit
    def shifted(model, du_embed, du_mid):
        edits = {
            sites[0]: lambda a, layer: a + du_embed,
            sites[1]: lambda a, layer: a + du_mid[layer],
        }
        return metric(intervene(model, ids, edits))

    rng = np.random.default_rng(0)
    eps = 1e-2
    for _ in range(3):
        u = [rng.standard_normal(vals[s].shape).astype(np.float32) for s in sites]
        norm = np.sqrt(sum((x**2).sum() for x in u))
        u = [x / norm for x in u]
        plus = shifted(model, eps * u[0], eps * u[1])
        minus = shifted(model, -eps * u[0], -eps * u[1])
        fd = float(plus - minus) / (2 * eps)
        lin = sum(float(np.vdot(grads[s], x)) for s, x in zip(sites, u, strict=True))
        scale = np.sqrt(sum(float((grads[s] ** 2).sum()) for s in sites))
        assert abs(fd - lin) <= 1e-2 * scale, (fd, lin, scale)


# ------------------------------------------------------ values by hand


def test_recorded_values_of_a_block_by_hand():
    """A pre-norm grouped-query SwiGLU block with RoPE: the sites against
    NumPy formulas of their definitions."""
    blk, x = block_of(rope_theta=1e4), stream()
    sites = [
        "hook_resid_pre", "ln1.hook_normalized", "attn.hook_v",
        "attn.hook_attn_scores", "attn.hook_pattern", "attn.hook_z",
        "hook_attn_out", "hook_resid_mid", "mlp.hook_pre", "mlp.hook_pre_linear",
        "mlp.hook_post", "hook_mlp_out", "hook_resid_post",
    ]  # fmt: skip
    out, v = capture(blk, x, sites, mask=CAUSAL)
    v = {k: np.asarray(a, np.float64) for k, a in v.items()}
    xs = np.asarray(x, np.float64)
    tol = dict(rtol=0, atol=1e-5)
    np.testing.assert_array_equal(v["hook_resid_pre"], xs)
    rms = np.sqrt(np.mean(xs**2, -1, keepdims=True) + EPS)
    np.testing.assert_allclose(v["ln1.hook_normalized"], xs / rms, **tol)
    # the pattern: the softmax of the scores, -inf and 0 above the diagonal
    scores, pattern = v["attn.hook_attn_scores"], v["attn.hook_pattern"]
    above = ~np.tril(np.ones((T, T), bool))
    assert scores.shape == pattern.shape == (H, T, T)
    assert np.all(np.isneginf(scores[:, above]))
    assert np.all(np.isfinite(scores[:, ~above]))
    np.testing.assert_array_equal(pattern[:, above], 0.0)
    np.testing.assert_allclose(pattern.sum(-1), 1.0, **tol)
    np.testing.assert_allclose(pattern, softmax(scores), **tol)
    # z: each head's pattern times its kv head's values (head i reads i // G)
    z = np.stack([pattern[i] @ v["attn.hook_v"][:, i // G] for i in range(H)], axis=1)
    np.testing.assert_allclose(v["attn.hook_z"], z, **tol)
    w_o = np.asarray(blk.attention.W_o.weight)
    np.testing.assert_allclose(
        v["hook_attn_out"], v["attn.hook_z"].reshape(T, H * P) @ w_o.T, **tol
    )
    np.testing.assert_allclose(
        v["hook_resid_mid"], v["hook_resid_pre"] + v["hook_attn_out"], **tol
    )
    gate = v["mlp.hook_pre"]
    silu = gate / (1 + np.exp(-gate))
    np.testing.assert_allclose(
        v["mlp.hook_post"], silu * v["mlp.hook_pre_linear"], **tol
    )
    np.testing.assert_allclose(
        v["hook_resid_post"], v["hook_resid_mid"] + v["hook_mlp_out"], **tol
    )
    np.testing.assert_array_equal(v["hook_resid_post"], out)


def test_recorded_values_of_a_decoder_by_hand():
    """The logits site is the logits; the final norm's site is
    $h / \\mathrm{rms}(h)$ of the last block's output; the first block reads
    the embedding."""
    model, ids = lm(), ids_of(0)
    sites = [
        "hook_embed", "blocks.*.hook_resid_pre", "blocks.*.hook_resid_post",
        "ln_final.hook_normalized", "unembed.hook_out",
    ]  # fmt: skip
    z, v = capture(model, ids, sites)
    np.testing.assert_array_equal(v["unembed.hook_out"], model(ids))
    np.testing.assert_array_equal(z, model(ids))
    np.testing.assert_array_equal(v["hook_embed"], model.token_emb.weight[ids])
    np.testing.assert_array_equal(v["blocks.*.hook_resid_pre"][0], v["hook_embed"])
    np.testing.assert_array_equal(
        v["blocks.*.hook_resid_pre"][1:], v["blocks.*.hook_resid_post"][:-1]
    )
    h = np.asarray(v["blocks.*.hook_resid_post"][-1], np.float64)
    eps = model.cfg.norm_eps
    normed = h / np.sqrt(np.mean(h**2, -1, keepdims=True) + eps)
    np.testing.assert_allclose(v["ln_final.hook_normalized"], normed, rtol=0, atol=1e-5)
    head = normed * np.asarray(model.norm.weight) @ np.asarray(model.head_weight).T
    np.testing.assert_allclose(
        v["unembed.hook_out"], head, rtol=0, atol=1e-5 * np.abs(head).max()
    )


def test_moe_router_sites_by_hand():
    r"""Router logits $= (\hat x \odot \gamma_2) W_r^\top$ on
    `ln2.hook_normalized` $\hat x$; choices the top-k experts by
    probability, in order."""
    cfg = MoEDecoderConfig.mixtral(
        V, D, H, 2, num_experts=4, top_k=2, num_kv_heads=KV, max_len=12
    )
    model, ids = sharpen(DecoderLM(cfg, key=jax.random.key(0)), 1), ids_of(0)
    sites = [
        "blocks.*.ln2.hook_normalized",
        "blocks.*.mlp.hook_router_logits",
        "blocks.*.mlp.hook_router_choices",
    ]
    _, v = capture(model, ids, sites)
    normed, logits, choices = (np.asarray(v[s]) for s in sites)
    assert choices.dtype == np.int32 and choices.shape == (2, T, 2)
    for layer in range(2):
        blk = model.stack.block(layer)
        x = normed[layer] * np.asarray(blk.norm2.weight)
        want = x @ np.asarray(blk.ffn.router.weight).T
        np.testing.assert_allclose(logits[layer], want, rtol=0, atol=1e-5)
        order = np.argsort(-softmax(want.astype(np.float64)), axis=-1, kind="stable")
        np.testing.assert_array_equal(choices[layer], order[:, :2])


# -------------------------------------------------- other models than DecoderLM


def test_capture_on_a_block_a_stack_and_a_charlm():
    blk, x = block_of(), stream()
    out, v = capture(blk, x, ["hook_resid_pre", "hook_resid_post"], mask=CAUSAL)
    np.testing.assert_array_equal(v["hook_resid_pre"], x)
    np.testing.assert_array_equal(v["hook_resid_post"], blk(x, CAUSAL))
    np.testing.assert_array_equal(out, blk(x, CAUSAL))

    stack = stack_of()
    sites = ["blocks.*.hook_resid_pre", "blocks.*.hook_resid_post"]
    out, v = capture(stack, x, sites, mask=CAUSAL)
    pre, post = (np.asarray(v[s]) for s in sites)
    assert pre.shape == post.shape == (2, T, D)
    np.testing.assert_array_equal(pre[0], x)
    np.testing.assert_array_equal(post[-1], out)
    for i in range(2):  # each block called by hand on its input
        np.testing.assert_allclose(
            post[i], stack.block(i)(jnp.asarray(pre[i]), CAUSAL), rtol=0, atol=1e-6
        )

    char = CharLM(V, D, H, 2, max_len=12, key=jax.random.key(4))
    ids = ids_of(0)
    sites = ["hook_embed", "hook_pos_embed", "blocks.*.hook_resid_pre"]
    z, v = capture(char, ids, [*sites, "unembed.hook_out"])
    np.testing.assert_array_equal(v["hook_embed"], char.token_emb.weight[ids])
    np.testing.assert_array_equal(v["hook_pos_embed"], char.pos_emb.weight[:T])
    np.testing.assert_array_equal(
        v["blocks.*.hook_resid_pre"][0], v["hook_embed"] + v["hook_pos_embed"]
    )
    np.testing.assert_array_equal(v["unembed.hook_out"], char(ids))
    np.testing.assert_array_equal(z, char(ids))


# ---------------------------------------------------------------- bad input


def test_bad_requests_are_refused_by_name(plain_python):
    model, ids = lm(), ids_of(0)
    with pytest.raises(bl.ConfigError, match="'blocks.*.hook_resid_pots' matches no"):
        capture(model, ids, "blocks.*.hook_resid_pots")
    with pytest.raises(bl.ConfigError, match="'blocks.7.*' matches no"):
        capture(model, ids, ["hook_embed", "blocks.7.*"])
    with pytest.raises(bl.ConfigError, match="'nope' matches no"):
        intervene(model, ids, {"nope": lambda a, layer: a})
    site = "blocks.*.hook_resid_post"
    with pytest.raises(
        bl.ConfigError, match=r"'blocks.\*.hook_resid_post' returned shape \(8, 3\)"
    ):
        intervene(model, ids, {site: lambda a, layer: a[..., :3]})
    with pytest.raises(bl.ConfigError, match=r"returned shape \(8, 32\) and dtype "):
        intervene(model, ids, {site: lambda a, layer: a.astype(jnp.float16)})
    with pytest.raises(bl.ConfigError, match="dtype float16, but the site holds"):
        intervene(model, ids, {site: lambda a, layer: a.astype(jnp.float16)})
    with pytest.raises(bl.ConfigError, match=r"edits\['hook_embed'\] must be a func"):
        intervene(model, ids, {"hook_embed": 0.0})
    with pytest.raises(bl.ConfigError, match="each entry must be a site name"):
        capture(model, ids, ["hook_embed", 3])
    linear = eqx.nn.Linear(D, D, key=jax.random.key(0))
    with pytest.raises(bl.ConfigError, match="Linear has no activation sites"):
        capture(linear, stream()[0], "hook_embed")


@pytest.mark.parametrize("sites", [3, None, {"hook_embed": 1}])
def test_sites_that_are_not_names_are_refused(plain_python, sites):
    with pytest.raises(bl.ConfigError, match="sites must be"):
        capture(lm(), ids_of(0), sites)
