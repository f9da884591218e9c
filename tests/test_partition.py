"""Logical axes of every parameter, rules and presets, and their refusals.

Runs on one device: layouts are checked on an `AbstractMesh` (no devices
needed), the training on simulated devices is tests/test_mesh_training.py.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, PartitionSpec

from blocklab import CharLM, ConfigError, DecoderConfig, DecoderLM, Stack
from blocklab.models import MoEDecoderConfig
from blocklab.training.placement import (
    LOGICAL_AXES,
    ActivationConstraint,
    logical_axes,
    param_shardings,
    parse_mesh,
    resolve_rules,
)


def _shape(make):
    return eqx.filter_eval_shape(make, jax.random.key(0))


def _leaves(tree):
    return jax.tree_util.tree_leaves_with_path(
        tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def _by_path(tree):
    return {jax.tree_util.keystr(p): tuple(s) for p, s in _leaves(tree)}


# A hand-written table for a Llama-like model (the reference the walk is
# checked against): every leaf, its names, nothing else.
LLAMA_AXES = {
    ".token_emb.weight": ("vocab", "embed"),
    ".stack.blocks.norm1.weight": ("layers", "embed"),
    ".stack.blocks.norm2.weight": ("layers", "embed"),
    ".stack.blocks.attention.W_q.weight": ("layers", "heads", "embed"),
    ".stack.blocks.attention.W_k.weight": ("layers", "kv_heads", "embed"),
    ".stack.blocks.attention.W_v.weight": ("layers", "kv_heads", "embed"),
    ".stack.blocks.attention.W_o.weight": ("layers", "embed", "heads"),
    ".stack.blocks.attention.rope_theta": (None,),
    ".stack.blocks.ffn.W_1.weight": ("layers", "mlp", "embed"),
    ".stack.blocks.ffn.W_g.weight": ("layers", "mlp", "embed"),
    ".stack.blocks.ffn.W_2.weight": ("layers", "embed", "mlp"),
    ".norm.weight": ("embed",),
    ".head.weight": ("vocab", "embed"),
}


def test_llama_axes_match_the_hand_written_table():
    cfg = DecoderConfig.llama(num_hiddens=48, num_heads=6, num_kv_heads=2, num_blks=3)
    assert _by_path(logical_axes(_shape(lambda k: DecoderLM(cfg, key=k)))) == (
        LLAMA_AXES
    )


FAMILIES = {
    "gpt2": lambda k: DecoderLM(DecoderConfig.gpt2(), key=k),
    "llama": lambda k: DecoderLM(DecoderConfig.llama(num_kv_heads=1), key=k),
    "olmo2": lambda k: DecoderLM(DecoderConfig.olmo2(num_hiddens=40), key=k),
    "gemma3": lambda k: DecoderLM(DecoderConfig.gemma3(num_blks=3), key=k),
    "mixtral": lambda k: DecoderLM(
        MoEDecoderConfig(64, 32, 4, 2, num_kv_heads=2, num_experts=4, top_k=2), key=k
    ),
    "charlm": lambda k: CharLM(28, 32, 2, 2, key=k),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_leaf_has_names_of_its_rank(family):
    model = _shape(FAMILIES[family])
    axes = logical_axes(model)
    names = dict(_leaves(axes))
    arrays = jax.tree_util.tree_leaves_with_path(model)
    assert len(arrays) == len(names)
    for path, leaf in arrays:
        spec = tuple(names[path])
        where = jax.tree_util.keystr(path)
        assert len(spec) == leaf.ndim, where
        if jnp.issubdtype(leaf.dtype, jnp.inexact):
            assert all(n in LOGICAL_AXES for n in spec), where
            assert len(set(spec)) == len(spec), where  # no name twice
            # stacked leaves lead with the block axis, and only they have it
            assert (spec[0] == "layers") == (".stack." in where), where
        else:  # windows, RoPE theta bits: replicated
            assert spec == (None,) * leaf.ndim, where
    # the names give each dimension's size consistently across the model
    sizes = {}
    for path, leaf in arrays:
        for n, size in zip(names[path], leaf.shape, strict=True):
            if n is not None:
                assert sizes.setdefault(n, size) == size, (
                    n,
                    jax.tree_util.keystr(path),
                )


def test_moe_experts_carry_the_expert_axis():
    axes = _by_path(logical_axes(_shape(FAMILIES["mixtral"])))
    assert axes[".stack.blocks.ffn.router.weight"] == ("layers", "experts", "embed")
    assert axes[".stack.blocks.ffn.experts.W_1.weight"] == (
        "layers", "experts", "mlp", "embed",
    )  # fmt: skip
    assert axes[".stack.blocks.ffn.experts.W_2.weight"] == (
        "layers", "experts", "embed", "mlp",
    )  # fmt: skip


def test_qk_norm_axes_follow_the_norm_kind():
    full = _by_path(logical_axes(_shape(FAMILIES["olmo2"])))
    head = _by_path(logical_axes(_shape(FAMILIES["gemma3"])))
    assert full[".stack.blocks.attention.q_norm.weight"] == ("layers", "heads")
    assert full[".stack.blocks.attention.k_norm.weight"] == ("layers", "kv_heads")
    assert head[".stack.blocks.attention.q_norm.weight"] == ("layers", "head_dim")
    assert head[".stack.blocks.attention.window"] == (None,)


def test_a_stacked_sweep_needs_the_member_prefix():
    model = _shape(
        lambda k: eqx.filter_vmap(FAMILIES["charlm"])(jax.random.split(k, 3))
    )
    with pytest.raises(ConfigError, match="members"):
        logical_axes(model)
    axes = _by_path(logical_axes(model, prefix=("members",)))
    assert axes[".token_emb.weight"] == ("members", "vocab", "embed")


def test_an_unknown_module_is_named():
    with pytest.raises(ConfigError, match=r"Linear at the root"):
        logical_axes(eqx.nn.Linear(3, 4, key=jax.random.key(0)))


def _elements_per_device(model, shardings, mesh):
    total = 0
    for x, s in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(shardings),
        strict=True,
    ):  # fmt: skip
        split = 1
        for entry in s.spec:
            for a in (entry,) if isinstance(entry, str) else entry or ():
                split *= mesh.shape[a]
        total += x.size // split
    return total


@pytest.mark.parametrize("n", [2, 8])
def test_fsdp_splits_every_weight_once_over_data(n):
    cfg = DecoderConfig.llama(num_hiddens=64, num_heads=4, num_kv_heads=2, num_blks=2)
    model = _shape(lambda k: DecoderLM(cfg, key=k))
    mesh = AbstractMesh((n,), ("data",))
    sh = param_shardings(model, mesh, "fsdp")
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(model), jax.tree_util.tree_leaves(sh),
        strict=True,
    ):  # fmt: skip
        if jnp.issubdtype(x.dtype, jnp.inexact):
            dims = [i for i, e in enumerate(s.spec) if e == "data"]
            assert len(dims) == 1 and x.shape[dims[0]] == 64, path
    total = sum(x.size for x in jax.tree_util.tree_leaves(model))
    ints = sum(
        x.size
        for x in jax.tree_util.tree_leaves(model)
        if not jnp.issubdtype(x.dtype, jnp.inexact)
    )
    per = _elements_per_device(model, sh, mesh)
    assert per == (total - ints) // n + ints  # 1/N of every float, ints replicated


def test_tp_is_megatron_columns_and_rows():
    cfg = DecoderConfig.llama(num_hiddens=64, num_heads=8, num_kv_heads=4, num_blks=2,
                              ffn_width=96)  # fmt: skip
    model = _shape(lambda k: DecoderLM(cfg, key=k))
    mesh = AbstractMesh((2, 4), ("data", "model"))
    sh = param_shardings(model, mesh, "tp")
    att, ffn = sh.stack.blocks.attention, sh.stack.blocks.ffn
    column, row = PartitionSpec(None, "model"), PartitionSpec(None, None, "model")
    assert [att.W_q.weight.spec, att.W_k.weight.spec, att.W_v.weight.spec] == [
        column
    ] * 3
    assert [ffn.W_1.weight.spec, ffn.W_g.weight.spec] == [column] * 2
    assert [att.W_o.weight.spec, ffn.W_2.weight.spec] == [row] * 2
    assert sh.token_emb.weight.spec == PartitionSpec("model")
    assert sh.norm.weight.spec == PartitionSpec()
    both = param_shardings(model, mesh, "fsdp+tp")
    assert both.stack.blocks.attention.W_o.weight.spec == PartitionSpec(
        None, "data", "model"
    )


def test_presets_put_the_batch_on_the_data_parallel_axes():
    mesh = AbstractMesh((2, 2, 2), ("data", "expert", "model"))
    assert resolve_rules("fsdp+tp+ep", mesh) == {
        "embed": ("data",), "heads": ("model",), "kv_heads": ("model",),
        "mlp": ("model",), "vocab": ("model",), "experts": ("expert",),
        "batch": ("data", "expert"),
    }  # fmt: skip
    assert resolve_rules("ep", AbstractMesh((4,), ("expert",)))["batch"] == ("expert",)


def test_refusals_name_the_axis_the_leaf_and_the_mesh():
    cfg = DecoderConfig.llama(num_hiddens=64, num_heads=4, num_kv_heads=2, num_blks=2)
    model = _shape(lambda k: DecoderLM(cfg, key=k))
    mesh = AbstractMesh((2, 4), ("data", "model"))
    with pytest.raises(
        ConfigError, match=r"'embed'.*'fsdp'.*\{'data': 2, 'model': 4\}"
    ):
        param_shardings(model, mesh, {"embed": "fsdp"})
    # the vocabulary (128 rows) does not split over 3 devices
    with pytest.raises(ConfigError) as err:
        param_shardings(model, AbstractMesh((3,), ("model",)), "tp")
    msg = str(err.value)
    assert ".token_emb.weight" in msg and "'vocab'" in msg and "'model'" in msg
    assert "size 128" in msg and "{'model': 3}" in msg
    # the heads: 4 x 16 = 64 query features over 3 devices (the vocab kept whole)
    rules = {"heads": "model"}
    with pytest.raises(ConfigError, match=r"W_q\.weight.*'heads'.*size 64"):
        param_shardings(model, AbstractMesh((3,), ("model",)), rules)
    with pytest.raises(ConfigError, match=r"preset 'tp' needs mesh axis 'model'"):
        param_shardings(model, AbstractMesh((8,), ("data",)), "tp")
    with pytest.raises(ConfigError, match="twice"):
        param_shardings(model, mesh, {"vocab": "model", "embed": "model"})
    with pytest.raises(ConfigError, match="preset"):
        resolve_rules("zero3", mesh)


def test_parse_mesh():
    assert parse_mesh("data=8,model=4") == {"data": 8, "model": 4}
    for bad in ["data8", "data=0", "data=2,data=2", "", "data=x"]:
        with pytest.raises(ConfigError, match="mesh"):
            parse_mesh(bad)


class _Scale(eqx.Module):
    w: jax.Array

    def __call__(self, x, valid_lens=None, *, key=None):
        return x * self.w


def test_the_block_constraint_is_an_identity_and_free_when_off():
    stack = Stack(
        lambda k: _Scale(jax.random.normal(k, (8,))), 3, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:1]), ("data",))
    on = stack.with_constraint(ActivationConstraint(mesh, ("data",)))

    def count(s):
        return str(jax.make_jaxpr(lambda x: s(x))(x)).count("sharding_constraint")

    assert count(stack) == 0
    assert count(on) == 2  # once per scan iteration (in the body) and on the output
    np.testing.assert_array_equal(np.asarray(on(x)), np.asarray(stack(x)))
    assert on.with_constraint(None).constrain is None


def test_a_mesh_size_or_a_rule_of_the_wrong_type_is_refused_by_name(plain_python):
    """`mesh_of({"data": 8.0})` said only "needs a size >= 1, got 8.0", and a
    rule `{"embed": 8}` failed with "'int' object is not iterable"."""
    from blocklab.training import mesh_of, shard

    with pytest.raises(
        ConfigError, match=r"axis 'data' needs an int size >= 1, got 8\.0 \(float\)"
    ):
        mesh_of({"data": 8.0})
    model = CharLM(28, 16, 2, 1, key=jax.random.key(0))
    with pytest.raises(
        ConfigError,
        match=r"rule for logical axis 'embed' must be a mesh axis name.*got 8",
    ):
        shard(model, mesh_of({"data": 1}), {"embed": 8})
