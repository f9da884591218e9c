"""`blocklab.interp.capture` under JAX's transformations (issue 32).

The model is a small Llama-style `DecoderLM` (RoPE, grouped-query attention
4:2, a window of 8 shorter than the 12-token prompts, SwiGLU, three layers):

- `jax.vmap` over prompts equals a Python loop over them, for stacked sites
  (every layer, `(L, ...)`), sites of some layers (`blocks.{l}.X`) and sites
  outside the stack;
- `jax.jit` equals eager;
- `jax.grad` of a loss on captured values (`blocks.*.hook_resid_mid` and one
  layer's pattern) with respect to the weights equals central finite
  differences along a random direction;
- capture on 8 simulated CPU devices (a fresh process, the batch sharded over
  a mesh, with data- and tensor-parallel layouts of the weights) equals the
  same process's one-device result;
- every `attention_impl` gives the reference's values at the sites every path
  has, and asking for `hook_pattern` under `"chunked"` runs the reference path
  for that call (its values are the reference's, bit for bit);
- capturing and editing nothing lowers to the plain forward's HLO, and
  capturing or editing something does not (Llama-style, GPT-2, Gemma 3 and
  Mixtral blocks);
- with sites captured or edited, a 6-layer stack lowers to one scan of 6
  iterations (`unroll=1`), not 6 unrolled blocks.
"""

from __future__ import annotations

import functools
import textwrap

import equinox as eqx
import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from _procs import script_json

import blocklab as bl
from blocklab.interp import capture, intervene, steer
from blocklab.models import MoEDecoderConfig
from blocklab.models.decoder_config import DecoderConfig

V, D, HEADS, KV, L, B, T, WINDOW = 64, 32, 4, 2, 3, 3, 12, 8

#: stacked (every layer), single-layer (pulled out of the stack) and outside.
SITES = [
    "blocks.*.hook_resid_post",
    "blocks.*.attn.hook_pattern",
    "blocks.1.attn.hook_rot_q",
    "blocks.0.attn.hook_k",
    "blocks.2.mlp.hook_post",
    "hook_embed",
    "ln_final.hook_normalized",
]


def _config(num_blks=L):
    return DecoderConfig.llama(
        V, D, HEADS, num_blks, num_kv_heads=KV, max_len=32, window=WINDOW, ffn_width=64
    )


@functools.cache
def _model(num_blks=L):
    return bl.DecoderLM(_config(num_blks), key=jax.random.key(0))


def _ids(batch=B, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, V, (batch, T)))


def assert_close(ours, ref, rtol, what=""):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    assert ours.dtype == ref.dtype == np.float32, what
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert scale > 0.01, (what, scale)  # not a comparison of zeros
    assert err <= rtol * scale, (what, err, scale)


def test_vmap_over_prompts_equals_a_loop():
    model, ids = _model(), _ids()
    one = jax.jit(lambda x: capture(model, x, SITES))
    logits, values = jax.vmap(one)(ids)
    loop = [one(x) for x in ids]
    assert values.keys() == set(SITES)
    # vmap puts the prompt axis first: (B, L, ...) for a stacked site
    assert values["blocks.*.hook_resid_post"].shape == (B, L, T, D)
    assert values["blocks.*.attn.hook_pattern"].shape == (B, L, HEADS, T, T)
    assert values["blocks.0.attn.hook_k"].shape == (B, T, KV, D // HEADS)
    assert values["blocks.1.attn.hook_rot_q"].shape == (B, T, HEADS, D // HEADS)
    for site in SITES:
        want = np.stack([np.asarray(v[site]) for _, v in loop])
        assert_close(values[site], want, 1e-6, site)
    assert_close(logits, np.stack([np.asarray(z) for z, _ in loop]), 1e-6)
    # a batch (B, T) in one call: stacked sites (L, B, ...), the rest (B, ...)
    _, batched = jax.jit(lambda x: capture(model, x, SITES))(ids)
    for site in SITES:
        got = batched[site]
        if site.startswith("blocks.*."):
            got = jnp.moveaxis(got, 1, 0)
        assert_close(got, values[site], 1e-5, f"batched {site}")
    # the prompts differ, so a vmap that broadcast one would not pass
    r = np.asarray(values["blocks.*.hook_resid_post"])
    assert np.abs(r[0] - r[1]).max() > 0.1


def test_jit_equals_eager():
    model, ids = _model(), _ids()
    eager_logits, eager = capture(model, ids, SITES)
    logits, values = jax.jit(lambda m, x: capture(m, x, SITES))(model, ids)
    assert values.keys() == eager.keys() == set(SITES)
    assert values["blocks.*.hook_resid_post"].shape == (L, B, T, D)
    for site in SITES:
        assert_close(values[site], eager[site], 1e-5, site)
    assert_close(logits, eager_logits, 1e-5)


def test_grad_through_captured_values_equals_finite_differences():
    r"""$\partial \ell / \partial \theta \cdot u$ against
    $(\ell(\theta + h u) - \ell(\theta - h u)) / 2h$, $u$ a random unit
    direction over every weight, for
    $\ell(\theta) = \sum R_1 \odot \mathrm{resid\_mid}
    + \sum R_2 \odot \mathrm{pattern}_1$ (float32: $h = 10^{-2}$, agreement
    to $10^{-3}$; the truncation error is $O(h^2)$, the rounding
    $O(\epsilon \ell / h)$)."""
    model, ids = _model(), _ids(2)
    rng = np.random.default_rng(1)
    r1 = jnp.asarray(rng.normal(size=(L, 2, T, D)), jnp.float32)
    r2 = jnp.asarray(rng.normal(size=(2, HEADS, T, T)), jnp.float32)

    @eqx.filter_jit
    def loss(m):
        _, v = capture(
            m, ids, ["blocks.*.hook_resid_mid", "blocks.1.attn.hook_pattern"]
        )
        return jnp.sum(r1 * v["blocks.*.hook_resid_mid"]) + 10 * jnp.sum(
            r2 * v["blocks.1.attn.hook_pattern"]
        )

    grads = eqx.filter_grad(loss)(model)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    u = [rng.normal(size=x.shape).astype(np.float32) for x in leaves]
    norm = np.sqrt(sum(float((a * a).sum()) for a in u))
    u = jax.tree_util.tree_unflatten(treedef, [jnp.asarray(a / norm) for a in u])

    def moved(h):
        p = jax.tree_util.tree_map(lambda x, d: x + h * d, params, u)
        return eqx.combine(p, static)

    h = 1e-2
    fd = (float(loss(moved(h))) - float(loss(moved(-h)))) / (2 * h)
    g = jax.tree_util.tree_leaves(eqx.filter(grads, eqx.is_inexact_array))
    directional = sum(
        float(jnp.vdot(a, b))
        for a, b in zip(g, jax.tree_util.tree_leaves(u), strict=True)
    )
    assert abs(fd) > 0.1  # a sharp comparison
    assert abs(directional - fd) <= 1e-3 * abs(fd), (directional, fd)


MESH_SCRIPT = textwrap.dedent(
    """
    import json
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import blocklab as bl
    from blocklab.interp import capture
    from blocklab.models.decoder_config import DecoderConfig
    from blocklab.training.placement import mesh_of

    cfg = DecoderConfig.llama(64, 32, 4, 3, num_kv_heads=2, max_len=32, window=8,
                              ffn_width=64)
    model = bl.DecoderLM(cfg, key=jax.random.key(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 12)))
    sites = ["blocks.*.hook_resid_post", "blocks.*.attn.hook_z",
             "blocks.1.attn.hook_pattern", "blocks.*.mlp.hook_post",
             "ln_final.hook_normalized"]
    run = jax.jit(lambda m, x: capture(m, x, sites))
    ref_logits, ref = run(model, ids)  # one device (device 0)
    ref = {"logits": ref_logits, **ref}
    out = {"devices": jax.device_count()}
    for spec, rules in (("data=8", "dp"), ("data=4,model=2", "fsdp+tp")):
        mesh = mesh_of(spec)
        m = bl.shard(model, mesh, rules)
        x = jax.device_put(ids, NamedSharding(mesh, P("data")))
        logits, got = run(m, x)
        got = {"logits": logits, **got}
        res = {}
        for k, v in got.items():
            a, b = np.asarray(v), np.asarray(ref[k])
            res[k] = {
                "shape": list(v.shape), "ref_shape": list(b.shape),
                "devices": len(v.sharding.device_set),
                "shard": list(v.addressable_shards[0].data.shape),
                "err": float(np.abs(a - b).max()), "scale": float(np.abs(b).max()),
            }
        out[spec] = res
    print(json.dumps(out))
    """
)


def test_capture_on_8_devices_equals_one_device():
    res = script_json(MESH_SCRIPT, devices=8, timeout=300)
    assert res["devices"] == 8
    for spec, shard_batch in (("data=8", 1), ("data=4,model=2", 2)):
        sites = res[spec]
        assert len(sites) == 6
        for site, r in sites.items():
            assert r["shape"] == r["ref_shape"], (spec, site)
            assert r["scale"] > 0.1 and r["err"] <= 1e-5 * r["scale"], (spec, site, r)
            # the values stay on the mesh, the prompts split over `data`
            assert r["devices"] == 8, (spec, site, r)
            batch_axis = 1 if site.startswith("blocks.*.") else 0
            assert r["shard"][batch_axis] == shard_batch, (spec, site, r)


REF_SITES = [
    "blocks.*.attn.hook_q",
    "blocks.*.attn.hook_k",
    "blocks.*.attn.hook_v",
    "blocks.*.attn.hook_rot_q",
    "blocks.*.attn.hook_rot_k",
    "blocks.*.attn.hook_z",
    "blocks.*.hook_resid_mid",
    "blocks.*.hook_resid_post",
]


def test_capture_under_every_attention_impl_equals_the_reference():
    model, ids = _model(), _ids()
    run = jax.jit(lambda m, x, sites: capture(m, x, sites), static_argnums=2)
    reference = bl.with_attention_impl(model, "reference")
    ref_logits, ref = run(reference, ids, tuple(REF_SITES))
    outputs = {}
    for impl in ("fused", "chunked", "auto"):
        m = bl.with_attention_impl(model, impl)
        logits, values = outputs[impl] = run(m, ids, tuple(REF_SITES))
        assert values.keys() == ref.keys()
        for site in REF_SITES:
            assert_close(values[site], ref[site], 1e-5, f"{impl} {site}")
        assert_close(logits, ref_logits, 1e-5, impl)
    # the chunked kernel's own result is not bit for bit the reference's ...
    assert not np.array_equal(outputs["chunked"][0], ref_logits)
    # ... but asking for the pattern (reference path only) under "chunked"
    # takes the reference path for that call: every value bit for bit
    with_pattern = (*REF_SITES, "blocks.*.attn.hook_pattern")
    ref_logits, ref = run(reference, ids, with_pattern)
    chunked = bl.with_attention_impl(model, "chunked")
    logits, values = run(chunked, ids, with_pattern)
    np.testing.assert_array_equal(logits, ref_logits)
    for site in with_pattern:
        np.testing.assert_array_equal(values[site], ref[site], err_msg=site)
    # the pattern's rows are distributions over the causal window
    p = np.asarray(values["blocks.*.attn.hook_pattern"])
    np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-6)
    i, j = np.indices((T, T))
    assert (p[..., (j > i) | (j <= i - WINDOW)] == 0).all()


def _hlo(fn, model, ids):
    return jax.jit(fn).lower(model, ids).as_text()


#: models of every kind of block for the HLO comparison: Llama-style (above),
#: GPT-2 (learned positions, LayerNorm, biases), Gemma 3 (sandwich norms,
#: QK-norm, local and global layers), Mixtral (top-2 of 4 experts).
HLO_MODELS = {
    "llama": _model,
    "gpt2": lambda: bl.DecoderLM(
        DecoderConfig.gpt2(V, D, HEADS, 2, max_len=32), key=jax.random.key(1)
    ),
    "gemma3": lambda: bl.DecoderLM(
        DecoderConfig.gemma3(V, D, HEADS, 2, max_len=32, window=4, global_every=2),
        key=jax.random.key(2),
    ),
    "mixtral": lambda: bl.DecoderLM(
        MoEDecoderConfig.mixtral(V, D, HEADS, 2, num_experts=4, max_len=32),
        key=jax.random.key(3),
    ),
}


@pytest.mark.parametrize(
    "kind",
    [
        "llama",
        pytest.param("gpt2", marks=pytest.mark.slow),
        pytest.param("gemma3", marks=pytest.mark.slow),
        "mixtral",
    ],
)
def test_nothing_captured_or_edited_lowers_to_the_plain_forward(kind):
    model, ids = HLO_MODELS[kind](), _ids()
    plain = _hlo(lambda m, x: m(x), model, ids)
    # capturing or editing something is another program: the test can fail
    something = _hlo(lambda m, x: capture(m, x, "blocks.*.hook_resid_mid"), model, ids)
    assert something != plain
    edit = {"blocks.1.hook_resid_mid": steer(jnp.ones(D), scale=0.5)}
    assert _hlo(lambda m, x: intervene(m, x, edit), model, ids) != plain
    assert _hlo(lambda m, x: intervene(m, x, {}), model, ids) == plain
    assert _hlo(lambda m, x: capture(m, x, [], edits={})[0], model, ids) == plain
    assert _hlo(lambda m, x: capture(m, x, [])[0], model, ids) == plain


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs inside it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def _program(fn, num_blks):
    jaxpr = jax.make_jaxpr(fn)(_model(num_blks), _ids()).jaxpr
    scans = [e for e in _eqns(jaxpr) if e.primitive.name == "scan"]
    dots = sum(e.primitive.name == "dot_general" for e in _eqns(jaxpr))
    return scans, dots


@pytest.mark.parametrize(
    "what",
    ["plain", "every layer", "one layer", "edit some layers"],
)
def test_a_scanned_stack_stays_one_scan(what):
    fns = {
        "plain": lambda m, x: m(x),
        "every layer": lambda m, x: capture(
            m, x, ["blocks.*.hook_resid_mid", "blocks.*.attn.hook_pattern"]
        ),
        "one layer": lambda m, x: capture(m, x, "blocks.2.attn.hook_z"),
        "edit some layers": lambda m, x: capture(
            m,
            x,
            "blocks.*.hook_resid_post",
            edits={"blocks.*.hook_resid_mid": steer(jnp.ones(D), layers=(0, 2))},
        ),
    }
    scans, dots = _program(fns[what], 6)
    assert len(scans) == 1, [e.params["length"] for e in scans]
    assert scans[0].params["length"] == 6 and scans[0].params["unroll"] == 1
    # the program does not grow with depth: as many products at 3 layers
    scans3, dots3 = _program(fns[what], 3)
    assert len(scans3) == 1 and scans3[0].params["length"] == 3
    assert dots == dots3
    hlo = jax.jit(fns[what]).lower(_model(6), _ids()).as_text()
    assert hlo.count("stablehlo.while") == 1


@pytest.mark.slow  # kept out of the default run for CI time
def test_vmap_over_a_sweeps_members_equals_each_member():
    """Members of a sweep are one pytree with a leading member axis (models
    built by `eqx.filter_vmap` over seeds): `capture` and an edit under
    `eqx.filter_vmap` over that axis equal each member's own call."""
    keys = jax.random.split(jax.random.key(7), 3)
    members = eqx.filter_vmap(lambda k: bl.DecoderLM(_config(), key=k))(keys)
    ids = _ids(batch=1)[0]
    sites = ["blocks.*.hook_resid_post", "blocks.1.attn.hook_z", "hook_embed"]
    push = steer(jnp.ones(D), scale=0.5, layers=[1])

    def run(m):
        out, acts = capture(m, ids, sites, edits={"blocks.*.hook_resid_mid": push})
        return out, acts

    outs, acts = eqx.filter_vmap(run)(members)
    for i, k in enumerate(keys):
        one = bl.DecoderLM(_config(), key=k)
        out, ref = run(one)
        assert_close(outs[i], out, 1e-5, f"member {i} logits")
        for name in sites:
            assert_close(acts[name][i], ref[name], 1e-5, f"member {i} {name}")
    assert float(np.abs(np.asarray(outs[0] - outs[1])).max()) > 1e-3  # distinct
