"""Rematerialization policies (`blocklab.nn.remat`, issue 36): every policy
gives the gradients of `"none"`; the checkpoint names are attached (they are
in the jaxpr, and the compiled step keeps exactly the named values: a
hand count of their bytes); the temporaries fall from `"none"` through
`"dots"` to `"full"`; bad policies are refused by name."""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import ConfigError, DecoderConfig, DecoderLM
from blocklab.nn.block import TransformerBlock
from blocklab.nn.hooks import Hooks
from blocklab.nn.remat import (
    NamedSites,
    check_remat,
    nested_groups,
    parse_remat,
    with_remat,
)
from blocklab.nn.stack import Stack

D, H, N, B, T = 16, 2, 5, 2, 8  # N = 5: nested groups of 2, 2 and a last of 1
F = round(8 * D / 3)  # SwiGLU's width


def _stack(remat="none", act="swiglu", num_blks=N):
    return Stack(
        lambda k: TransformerBlock(D, H, act=act, key=k), num_blks, remat=remat,
        key=jax.random.key(0),
    )  # fmt: skip


def _x(dtype=jnp.float32):
    return jax.random.normal(jax.random.key(1), (B, T, D), dtype)


def _loss(stack, x):
    lens = jnp.arange(1, T + 1)
    return jnp.mean(jnp.tanh(stack(x, lens)) ** 2)


def _compiled(stack, x):
    params, static = eqx.partition(stack, eqx.is_inexact_array)

    def f(p, x):
        return jax.value_and_grad(lambda p: _loss(eqx.combine(p, static), x))(p)

    jaxpr = str(jax.make_jaxpr(f)(params, x))
    compiled = jax.jit(f).lower(params, x).compile()
    loss, grads = compiled(params, x)
    return loss, grads, compiled.memory_analysis().temp_size_in_bytes, jaxpr


POLICIES = ["none", "dots", "full", "nested", "names:mlp.hook_post"]


@pytest.fixture(scope="module")
def results():
    """Loss, gradients, temporaries and jaxpr of each policy (compiled once)."""
    x = _x()
    base = _stack()
    return {p: _compiled(with_remat(base, p), x) for p in POLICIES}


def _max_diff(a, b):
    return max(
        float(jnp.max(jnp.abs(u - v)))
        for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    )


@pytest.mark.parametrize("policy", POLICIES[1:])
def test_every_policy_gives_the_loss_and_gradients_of_none(results, policy):
    loss0, g0, _, _ = results["none"]
    loss, g, _, _ = results[policy]
    np.testing.assert_allclose(loss, loss0, rtol=1e-6)
    scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(g0))
    assert _max_diff(g, g0) <= 1e-5 * scale


def test_the_names_are_attached_and_keep_exactly_the_named_values(results):
    # Per block, "full" keeps the block's input (B x T x D float32) and
    # names:mlp.hook_post also the FFN's hidden activation (B x T x F): one
    # more block adds exactly those bytes (hand count). Without the names
    # attached, the named policy would keep what "full" keeps.
    _, _, full, _ = results["full"]
    _, _, named, jaxpr = results["names:mlp.hook_post"]
    assert "name[name=blocks.*.mlp.hook_post]" in jaxpr  # the tag, not the policy
    x, deeper = _x(), _stack(num_blks=N + 1)
    full_1 = _compiled(with_remat(deeper, "full"), x)[2]
    named_1 = _compiled(with_remat(deeper, "names:mlp.hook_post"), x)[2]
    assert full_1 - full == B * T * D * 4
    assert named_1 - named == B * T * (D + F) * 4


def test_temporaries_fall_from_none_through_dots_to_full(results):
    temp = {p: results[p][2] for p in POLICIES}
    assert temp["none"] > temp["dots"] > temp["full"]
    # "none" and "full" add no names to the program (only name-reading
    # policies tag the sites)
    for p in ("none", "full", "dots", "nested"):
        assert "name[name=" not in results[p][3]


def test_a_checkpoint_policies_callable_reads_the_names():
    policy = jax.checkpoint_policies.save_only_these_names("blocks.*.mlp.hook_post")
    stack = _stack(policy)
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss))(stack, _x()))
    assert "name[name=blocks.*.attn.hook_q]" in jaxpr  # every site is tagged
    assert check_remat("t", policy) is policy


@pytest.mark.parametrize("impl", ["chunked", "fused"])
def test_every_named_site_is_tagged_on_the_fast_attention_paths(impl):
    sites = ["attn.hook_q", "attn.hook_k", "attn.hook_v", "attn.hook_z",
             "hook_attn_out", "mlp.hook_pre", "mlp.hook_post",
             "hook_resid_post"]  # fmt: skip
    stack = Stack(
        lambda k: TransformerBlock(D, H, attention_impl=impl, key=k), 2,
        remat="names:" + ",".join(sites), key=jax.random.key(0),
    )  # fmt: skip
    jaxpr = str(jax.make_jaxpr(jax.grad(_loss))(stack, _x()))
    for site in sites:
        assert f"name[name=blocks.*.{site}]" in jaxpr, site
    assert "hook_pattern" not in jaxpr  # the reference path was not taken


@pytest.mark.slow
@pytest.mark.float64
def test_dots_in_float32_against_none_in_float64():
    x64 = _x(jnp.float64)
    stack64 = jax.tree.map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, _stack()
    )
    _, g64, _, _ = _compiled(stack64, x64)
    _, g32, _, _ = _compiled(_stack("dots"), x64.astype(jnp.float32))
    scale = max(float(jnp.max(jnp.abs(v))) for v in jax.tree.leaves(g64))
    assert _max_diff(jax.tree.map(lambda a: a.astype(jnp.float64), g32), g64) <= (
        1e-5 * scale
    )


@pytest.mark.parametrize(
    "policy", ["names:hook_resid_post", pytest.param("nested", marks=pytest.mark.slow)]
)
def test_captures_under_a_policy_are_those_without(policy):
    x = _x()
    name = "blocks.*.hook_resid_post"
    plain, hooks = _stack(), Hooks(record=[name])
    plain(x, hooks=hooks)
    other = Hooks(record=[name])
    with_remat(plain, policy)(x, hooks=other)
    assert other.values[name].shape == (N, B, T, D)
    np.testing.assert_allclose(other.values[name], hooks.values[name], atol=1e-6)
    # the naming hooks ask for nothing: modules keep their fast paths
    named = NamedSites(None, set())
    assert not named.wants("attn.hook_pattern") and not named.under("attn")


def test_bad_policies_are_refused_by_name():
    for bad, match in [
        ("bogus", "remat must be"),
        (3, "remat must be"),
        ("names:", "lists no site"),
        ("names:attn.hook_nope", "attn.hook_nope"),
        ("offload:mlp.hook_post", "offload needs a backend"),
    ]:
        with pytest.raises(ConfigError, match=match):
            _stack(bad)
    # a site this block does not carry (an ungated FFN has no linear branch)
    stack = _stack("names:mlp.hook_pre_linear", act="gelu")
    with pytest.raises(ConfigError, match="mlp.hook_pre_linear"):
        stack(_x())


def test_offload_builds_jax_offload_policy_where_supported():
    r = parse_remat("t", "offload:blocks.*.mlp.hook_post, attn.hook_q", backend="gpu")
    assert r.kind == "offload" and r.names == ("mlp.hook_post", "attn.hook_q")
    assert r.full_names == ("blocks.*.mlp.hook_post", "blocks.*.attn.hook_q")
    assert callable(r.jax_policy())


def test_nested_groups_are_about_sqrt_depth():
    assert nested_groups(16) == (4, 4, 0)
    assert nested_groups(5) == (2, 2, 1)
    assert nested_groups(1) == (1, 1, 0)


def test_decoder_config_and_model_carry_the_policy():
    cfg = DecoderConfig.llama(num_hiddens=16, num_heads=2, num_blks=2, remat="dots")
    assert cfg.remat == "dots" and DecoderConfig(**cfg.to_dict()) == cfg
    assert DecoderConfig.llama(remat=True).remat is True
    model = DecoderLM(cfg, key=jax.random.key(0))
    assert model.stack.remat == "dots"
    full = with_remat(model, "names:blocks.*.attn.hook_q")
    assert full.stack.remat == full.cfg.remat == "names:attn.hook_q"
    fn = jax.checkpoint_policies.nothing_saveable
    assert "remat" not in with_remat(model, fn).cfg.to_dict()  # not JSON
    with pytest.raises(ConfigError, match="DecoderConfig: remat must be"):
        DecoderConfig.llama(remat="some")


@pytest.mark.slow  # every section of the GPU script at tiny sizes, in a child
def test_the_gpu_script_runs_every_section_in_smoke_mode(tmp_path):
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "gpu.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "benchmarks", "gpu.py"), "--smoke",
         "--out", str(out)],
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["sections"]) == {"attention", "mfu", "decode", "sweep"}
    for name, section in report["sections"].items():
        assert "error" not in section, (name, section.get("traceback"))
    assert (tmp_path / "gpu.md").read_text().startswith("Device:")
    for pol in ("none", "dots", "full", "nested"):
        assert report["sections"]["mfu"]["policies"][pol]["mfu"] > 0
