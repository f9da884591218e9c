r"""One model across devices: logical axes, rules, presets and `shard`.

Every array of a blocklab model has **logical axes**: one name per dimension
saying what the dimension *is*, independent of any device layout.

| name        | dimension                                                   |
|-------------|-------------------------------------------------------------|
| `vocab`     | token ids $V$ (embedding rows, head rows)                   |
| `position`  | rows of a learned position table                            |
| `embed`     | the model width $d$                                         |
| `heads`     | the $H p$ query features ($H$ heads of width $p$, head-major)|
| `kv_heads`  | the $K p$ key/value features                                |
| `head_dim`  | the $p$ features of one head (a per-head QK-norm gain)      |
| `mlp`       | the FFN hidden width                                        |
| `experts`   | the expert axis of a mixture of experts                     |
| `layers`    | the block axis of a `Stack` (its scan axis)                 |
| `members`   | the member axis of a sweep                                  |

Integer leaves (a layer's window, its RoPE $\theta$ bits) get `None` on every
dimension: they are replicated. `logical_axes(model)` returns these names as a
pytree with the model's structure, one `PartitionSpec` of names per array.

**Rules** map logical names to mesh axes, $r:\ \text{name} \mapsto$ a mesh
axis, a tuple of mesh axes, or `None` (replicated). An array with logical
axes $(n_1, \ldots, n_r)$ is laid out as `PartitionSpec(r(n_1), ..., r(n_r))`;
dimension $i$ of size $D_i$ is split into $D_i / \prod_{a \in r(n_i)}
|a|$ contiguous pieces, one per device coordinate along those mesh axes.
Presets (`PRESETS`, combined with `+`, e.g. `"fsdp+tp"`):

- `"dp"`: parameters replicated, the batch over `data`;
- `"fsdp"`: every weight split along its `embed` axis over `data` (each
  matrix of a decoder has one), the batch over `data`: ZeRO-3 / FSDP,
  parameters and optimizer state at $1/N$ per device, gathered per use;
- `"tp"`: Megatron column splits (the `heads`, `kv_heads`, `mlp` outputs of
  $W_q, W_k, W_v, W_1, W_g$, and the `vocab` rows of the embedding and head)
  and row splits ($W_o$, $W_2$ along the same names) over `model`;
- `"ep"`: `experts` over `expert`, the batch over `expert` (and `data`).

Activations have their own names: `batch`, `seq` and `act_embed` for the
hidden state $(B, T, d)$ between blocks; the presets put `batch` on the
data-parallel axes (`data`, `expert`, whichever the mesh has) and leave
the others replicated. `shard` installs that constraint on every `Stack`
(`Stack.with_constraint`), so GSPMD does not guess the layout between blocks.

**Axis types.** A mesh's axes are `Auto` (GSPMD propagates the layout of
every intermediate value) or `Explicit` (the layout is part of each array's
type, JAX's explicit sharding; `jax.make_mesh` makes them by default), or a
mix. Every function here takes either. The arrays are laid out on the
mesh as given, so their type carries the layout on `Explicit` axes. The
modules of blocklab are written for propagation: a forward under explicit
sharding would have to say the output layout of every ambiguous gather and
contraction. So the programs of blocklab (training, sweeps) compute on
`auto_mesh(mesh)`, the same devices and names with every axis `Auto`, as
`jax.sharding.auto_axes` does for one region of a program, and move the
arrays between the two without copying (`on_mesh`). A forward of your own
on a mesh with `Explicit` axes runs the model inside
`jax.sharding.auto_axes` (see `shard`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from .._validate import ConfigError
from ..models.charlm import CharLM
from ..models.decoder import DecoderLM
from ..models.encoder import EncoderModel
from ..models.encoder_decoder import EncoderDecoderLM
from ..nn.attention import MultiHeadAttention
from ..nn.audio_embed import AudioEmbedding
from ..nn.block import TransformerBlock
from ..nn.ffn import FeedForward
from ..nn.moe import MoEFeedForward
from ..nn.normalization import LayerNorm, RMSNorm
from ..nn.patch_embed import ViTEmbedding
from ..nn.relative_position import RelativePositionBias
from ..nn.stack import Stack

__all__ = [
    "ACTIVATION_AXES",
    "LOGICAL_AXES",
    "PRESETS",
    "ActivationConstraint",
    "abstract_shard",
    "auto_mesh",
    "check_mesh",
    "logical_axes",
    "mesh_of",
    "on_mesh",
    "param_shardings",
    "parse_mesh",
    "place",
    "resolve_rules",
    "shard",
    "with_constraints",
]

#: The logical names of parameter dimensions.
LOGICAL_AXES = (
    "vocab", "position", "embed", "heads", "kv_heads", "head_dim", "mlp",
    "experts", "layers", "members",
)  # fmt: skip
#: The logical names of the hidden state between blocks, `(batch, seq, act_embed)`.
ACTIVATION_AXES = ("batch", "seq", "act_embed")

#: Presets: logical name -> mesh axis. `batch` is added by `resolve_rules`
#: (the data-parallel axes the mesh has), so it is not listed here.
PRESETS: dict[str, dict[str, str]] = {
    "dp": {},
    "fsdp": {"embed": "data"},
    "tp": {"heads": "model", "kv_heads": "model", "mlp": "model", "vocab": "model"},
    "ep": {"experts": "expert"},
}
#: The mesh axis each preset needs.
_NEEDS = {"dp": "data", "fsdp": "data", "tp": "model", "ep": "expert"}
#: Mesh axes that carry the batch (data parallelism), in this order.
_DATA_AXES = ("data", "expert")

Rules = Mapping[str, "str | tuple[str, ...] | None"]


# ---------------------------------------------------------------------------
# Logical axes


def _is_leaf_array(x: Any) -> bool:
    return isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)


class _Walk:
    """Collects `{path: names}` for every array of a model, by module type."""

    def __init__(self):
        self.names: dict[str, tuple] = {}

    def leaf(self, x: Any, path: str, lead: tuple, names: tuple) -> None:
        if x is None:
            return
        if not _is_leaf_array(x):
            return
        full = (*lead, *names)
        if not jnp.issubdtype(x.dtype, jnp.inexact):
            full = (None,) * len(x.shape)  # integer data is replicated
        if len(full) != len(x.shape):
            raise ConfigError(
                f"logical_axes: leaf {path} has shape {tuple(x.shape)} but its "
                f"logical axes are {full}; is the model stacked (a sweep's members)? "
                "Pass prefix=('members',)."
            )
        self.names[path] = full

    def linear(self, lin: Any, path: str, lead: tuple, out: str, inp: str) -> None:
        if lin is None:
            return
        if hasattr(lin, "add_delta"):  # a LoRA adapter: the axes of its weight
            self.linear(lin.base, f"{path}.base", lead, out, inp)
            self.leaf(lin.A, f"{path}.A", lead, (None, inp))  # rank replicated
            self.leaf(lin.B, f"{path}.B", lead, (out, None))
            return
        self.leaf(lin.weight, f"{path}.weight", lead, (out, inp))
        self.leaf(getattr(lin, "bias", None), f"{path}.bias", lead, (out,))

    def embedding(self, emb: Any, path: str, lead: tuple, rows: str) -> None:
        if emb is not None:
            self.leaf(emb.weight, f"{path}.weight", lead, (rows, "embed"))

    def norm(self, norm: Any, path: str, lead: tuple, name: str) -> None:
        if norm is None:
            return
        if not isinstance(norm, (RMSNorm, LayerNorm)):
            self.unknown(norm, path)
        self.leaf(norm.weight, f"{path}.weight", lead, (name,))
        self.leaf(getattr(norm, "bias", None), f"{path}.bias", lead, (name,))

    def ffn(self, ffn: FeedForward, path: str, lead: tuple) -> None:
        self.linear(ffn.W_1, f"{path}.W_1", lead, "mlp", "embed")
        self.linear(getattr(ffn, "W_g", None), f"{path}.W_g", lead, "mlp", "embed")
        self.linear(ffn.W_2, f"{path}.W_2", lead, "embed", "mlp")

    def attention(self, att: MultiHeadAttention, path: str, lead: tuple) -> None:
        self.linear(att.W_q, f"{path}.W_q", lead, "heads", "embed")
        self.linear(att.W_k, f"{path}.W_k", lead, "kv_heads", "embed")
        self.linear(att.W_v, f"{path}.W_v", lead, "kv_heads", "embed")
        self.linear(att.W_o, f"{path}.W_o", lead, "embed", "heads")
        full = att.qk_norm == "full"
        self.norm(att.q_norm, f"{path}.q_norm", lead, "heads" if full else "head_dim")
        self.norm(
            att.k_norm, f"{path}.k_norm", lead, "kv_heads" if full else "head_dim"
        )
        for name in ("rope_theta", "window"):
            self.leaf(getattr(att, name), f"{path}.{name}", lead, ())

    def block(self, blk: TransformerBlock, path: str, lead: tuple) -> None:
        for name in (
            "norm1", "norm2", "out_norm1", "out_norm2", "norm_cross", "out_norm_cross"
        ):  # fmt: skip
            self.norm(getattr(blk, name, None), f"{path}.{name}", lead, "embed")
        self.module(blk.attention, f"{path}.attention", lead)
        self.module(getattr(blk, "cross_attn", None), f"{path}.cross_attn", lead)
        self.module(blk.ffn, f"{path}.ffn", lead)
        self.leaf(getattr(blk, "skip_norm1", None), f"{path}.skip_norm1", lead, ())

    def encoder(self, node: EncoderModel, path: str, lead: tuple) -> None:
        """An encoder's embeddings, stack, norms and heads."""
        for name, rows in (
            ("token_emb", "vocab"), ("pos_emb", "position"), ("type_emb", None)
        ):  # fmt: skip
            self.embedding(getattr(node, name), f"{path}.{name}", lead, rows)
        self.module(node.vit_emb, f"{path}.vit_emb", lead)
        self.module(node.rel_bias, f"{path}.rel_bias", lead)
        self.module(node.stack, f"{path}.stack", lead)
        for name in ("emb_norm", "norm", "mlm_norm", "pooler_norm"):
            self.norm(getattr(node, name), f"{path}.{name}", lead, "embed")
        self.linear(node.mlm_dense, f"{path}.mlm_dense", lead, None, "embed")
        self.linear(node.mlm_decoder, f"{path}.mlm_decoder", lead, "vocab", "embed")
        self.leaf(node.mlm_bias, f"{path}.mlm_bias", lead, ("vocab",))
        self.linear(node.pooler_dense, f"{path}.pooler_dense", lead, None, "embed")
        self.linear(node.classifier, f"{path}.classifier", lead, None, "embed")

    def module(self, node: Any, path: str, lead: tuple) -> None:
        if node is None:
            return
        if isinstance(node, (DecoderLM, CharLM)):
            self.embedding(node.token_emb, f"{path}.token_emb", lead, "vocab")
            self.embedding(node.pos_emb, f"{path}.pos_emb", lead, "position")
            self.module(node.stack, f"{path}.stack", lead)
            self.norm(node.norm, f"{path}.norm", lead, "embed")
            self.linear(getattr(node, "head", None), f"{path}.head", lead, "vocab",
                        "embed")  # fmt: skip
        elif isinstance(node, EncoderModel):
            self.encoder(node, path, lead)
        elif isinstance(node, EncoderDecoderLM):
            self.embedding(node.token_emb, f"{path}.token_emb", lead, "vocab")
            for name in ("encoder", "decoder", "enc_rel_bias", "dec_rel_bias"):
                self.module(getattr(node, name), f"{path}.{name}", lead)
            for name in ("enc_norm", "dec_norm"):
                self.norm(getattr(node, name), f"{path}.{name}", lead, "embed")
            self.linear(node.head, f"{path}.head", lead, "vocab", "embed")
            self.module(node.audio_emb, f"{path}.audio_emb", lead)
            self.embedding(node.dec_pos_emb, f"{path}.dec_pos_emb", lead, "position")
        elif isinstance(node, AudioEmbedding):
            # conv2 maps embed -> embed: one of its axes is named (a mesh axis
            # cannot split two dimensions of one array)
            for name in ("conv1", "conv2"):
                w = getattr(node, f"{name}_weight")
                self.leaf(w, f"{path}.{name}_weight", lead, ("embed", None, None))
                b = getattr(node, f"{name}_bias")
                self.leaf(b, f"{path}.{name}_bias", lead, ("embed",))
            self.leaf(node.pos_emb, f"{path}.pos_emb", lead, ("position", "embed"))
        elif isinstance(node, RelativePositionBias):
            self.leaf(node.weight, f"{path}.weight", lead, (None, None))  # small
        elif isinstance(node, ViTEmbedding):
            self.leaf(node.patch.weight, f"{path}.patch.weight", lead,
                      ("embed", None, None, None))  # fmt: skip
            self.leaf(node.patch.bias, f"{path}.patch.bias", lead, ("embed",))
            self.leaf(node.cls_token, f"{path}.cls_token", lead, ("embed",))
            self.leaf(node.pos_emb, f"{path}.pos_emb", lead, ("position", "embed"))
        elif isinstance(node, Stack):
            self.module(node.blocks, f"{path}.blocks", (*lead, "layers"))
        elif isinstance(node, TransformerBlock):
            self.block(node, path, lead)
        elif isinstance(node, MultiHeadAttention):
            self.attention(node, path, lead)
        elif isinstance(node, MoEFeedForward):
            self.linear(node.router, f"{path}.router", lead, "experts", "embed")
            self.ffn(node.experts, f"{path}.experts", (*lead, "experts"))
        elif isinstance(node, FeedForward):
            self.ffn(node, path, lead)
        elif isinstance(node, (RMSNorm, LayerNorm)):
            self.norm(node, path, lead, "embed")
        else:
            self.unknown(node, path)

    @staticmethod
    def unknown(node: Any, path: str) -> None:
        raise ConfigError(
            f"logical_axes: no logical axes for {type(node).__name__} at "
            f"{path or 'the root'}; known modules: DecoderLM, CharLM, "
            "EncoderModel, EncoderDecoderLM, RelativePositionBias, ViTEmbedding, "
            "AudioEmbedding, "
            "Stack, "
            "TransformerBlock, MultiHeadAttention, FeedForward, MoEFeedForward, "
            "RMSNorm, LayerNorm."
        )


def logical_axes(model: Any, *, prefix: Sequence[str] = ()) -> Any:
    """The logical axes of every array of `model`, as a pytree of its structure.

    Each array (or `jax.ShapeDtypeStruct`) leaf becomes a `PartitionSpec` of
    logical names, one per dimension (see the module docstring); integer
    leaves get `None` on every dimension (replicated). Derived from the module
    types (`DecoderLM`, `CharLM`, `Stack`, `TransformerBlock`,
    `MultiHeadAttention`, `FeedForward`, `MoEFeedForward`, the norms), not
    from sizes, so any width, head ratio or depth works.

    Args:
        model: a module of those types (e.g. from `eqx.filter_eval_shape`).
        prefix: names of extra leading dimensions on every leaf, e.g.
            `("members",)` for a sweep's stacked models.

    Raises:
        ConfigError: a module of another type, naming it and where it is.
    """
    walk = _Walk()
    walk.module(model, "", tuple(prefix))

    def spec(path, x):
        if not _is_leaf_array(x):
            return x
        key = jax.tree_util.keystr(path)
        if key not in walk.names:
            raise ConfigError(
                f"logical_axes: leaf {key} of a {type(model).__name__} has no "
                "logical axes (a field the module types do not declare)."
            )
        return PartitionSpec(*walk.names[key])

    return jax.tree_util.tree_map_with_path(spec, model)


# ---------------------------------------------------------------------------
# Rules


def _mesh_desc(mesh: Any) -> str:
    return "mesh " + str(dict(mesh.shape))


def resolve_rules(rules: str | Rules, mesh: Any) -> dict[str, tuple[str, ...]]:
    """Rules (a preset name like `"fsdp+tp"`, or a mapping) as `{name: mesh axes}`.

    A preset also maps `batch` to the data-parallel axes the mesh has
    (`data`, `expert`), and `members` to `members` when the mesh has it.
    A mapping is taken as given (values: a mesh axis, a tuple of them, or
    `None`), plus `members` -> `members` if the mesh has that axis.

    Raises:
        ConfigError: an unknown preset, a preset whose mesh axis the mesh
            lacks, a rule naming a mesh axis that does not exist, or a mesh
            axis used by two logical names that share an array.
    """
    owner = "shard"
    axes = tuple(mesh.axis_names)
    if isinstance(rules, str):
        parts = [p.strip() for p in rules.split("+")]
        out: dict[str, tuple[str, ...]] = {}
        for part in parts:
            if part not in PRESETS:
                raise ConfigError(
                    f"{owner}: rules must be a mapping or a preset from "
                    f"{sorted(PRESETS)} joined by '+', got {rules!r}."
                )
            if _NEEDS[part] not in axes:
                raise ConfigError(
                    f"{owner}: preset {part!r} needs mesh axis {_NEEDS[part]!r}, "
                    f"which {_mesh_desc(mesh)} does not have."
                )
            for name, axis in PRESETS[part].items():
                out[name] = (*out.get(name, ()), axis)
        batch = tuple(a for a in _DATA_AXES if a in axes)
        if batch:
            out["batch"] = batch
    elif isinstance(rules, Mapping):
        out = {}
        for name, value in rules.items():
            if value is None:
                out[name] = ()
                continue
            if not isinstance(value, str) and not (
                isinstance(value, (tuple, list))
                and all(isinstance(a, str) for a in value)
            ):
                raise ConfigError(
                    f"{owner}: the rule for logical axis {name!r} must be a mesh "
                    f"axis name, a tuple of them or None, got {value!r}; mesh axes: "
                    f"{list(axes)}."
                )
            value = (value,) if isinstance(value, str) else tuple(value)
            for a in value:
                if a not in axes:
                    raise ConfigError(
                        f"{owner}: the rule for logical axis {name!r} names mesh "
                        f"axis {a!r}, which {_mesh_desc(mesh)} does not have "
                        f"(axes {list(axes)})."
                    )
            out[name] = value
    else:
        raise ConfigError(
            f"{owner}: rules must be a mapping or a preset from {sorted(PRESETS)}, "
            f"got {type(rules).__name__}."
        )
    if "members" in axes:
        out.setdefault("members", ("members",))
    return out


def _mesh_spec(
    names: PartitionSpec, shape: tuple, rules: Mapping, mesh: Any, path: str
) -> PartitionSpec:
    """Logical names -> a mesh `PartitionSpec`, checking divisibility."""
    out, used = [], {}
    for dim, (name, size) in enumerate(zip(names, shape, strict=True)):
        mesh_axes = tuple(rules.get(name, ())) if name is not None else ()
        for a in mesh_axes:
            if a in used:
                raise ConfigError(
                    f"shard: leaf {path} would use mesh axis {a!r} twice (for "
                    f"logical axes {used[a]!r} and {name!r}) on {_mesh_desc(mesh)}; "
                    "map them to different mesh axes."
                )
            used[a] = name
        n = int(np.prod([mesh.shape[a] for a in mesh_axes], dtype=np.int64))
        if size % n:
            raise ConfigError(
                f"shard: leaf {path} has dimension {dim} ({name!r}) of size {size}, "
                f"not divisible by mesh axis {mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]!r} "  # noqa: E501
                f"of size {n} on {_mesh_desc(mesh)}."
            )
        out.append(None if not mesh_axes else mesh_axes[0] if len(mesh_axes) == 1
                   else mesh_axes)  # fmt: skip
    while out and out[-1] is None:
        out.pop()
    return PartitionSpec(*out)


def check_mesh(mesh: Any, *, _owner: str = "shard") -> None:
    """Refuse anything but a `jax.sharding.Mesh` over every device
    (`jax.device_count()`) whose axes are `Auto` or `Explicit`."""
    owner = _owner
    if not isinstance(mesh, Mesh):
        raise ConfigError(
            f"{owner}: mesh must be a jax.sharding.Mesh, got {mesh!r} "
            f"({type(mesh).__name__}); build one with jax.make_mesh((8,), "
            "('data',)) or blocklab.training.mesh_of('data=8')."
        )
    manual = [
        n for n, t in zip(mesh.axis_names, mesh.axis_types, strict=True)
        if t not in (AxisType.Auto, AxisType.Explicit)
    ]  # fmt: skip
    if manual:
        raise ConfigError(
            f"{owner}: mesh axis {manual[0]!r} of {_mesh_desc(mesh)} has axis type "
            f"{dict(zip(mesh.axis_names, mesh.axis_types, strict=True))[manual[0]]}; "
            "the axes must be AxisType.Auto or AxisType.Explicit (a Manual axis "
            "exists inside jax.shard_map only)."
        )
    if mesh.devices.size != jax.device_count():
        raise ConfigError(
            f"{owner}: {_mesh_desc(mesh)} has {mesh.devices.size} devices but "
            f"jax.device_count() is {jax.device_count()}; a mesh must span every "
            "device (set XLA_FLAGS=--xla_force_host_platform_device_count or "
            "build the mesh over jax.devices())."
        )


def auto_mesh(mesh: Any) -> Any:
    """`mesh` with its `Explicit` axes made `Auto`: the same devices, in the same
    order, and the same names (a `Mesh` or an `AbstractMesh`; `mesh` itself
    when none is `Explicit`).

    The mesh blocklab's programs compute on (see the module docstring): an
    array laid out on `mesh` is laid out on `auto_mesh(mesh)` by the same
    buffers, and `jax.device_put` between the two moves no data.
    """
    types = tuple(mesh.axis_types)
    if AxisType.Explicit not in types:
        return mesh
    return mesh.update(
        axis_types=tuple(AxisType.Auto if t == AxisType.Explicit else t for t in types)
    )


def on_mesh(tree: Any, mesh: Mesh) -> Any:
    """Every array of `tree` laid out on another view of `mesh` (the same devices
    and axis names, other axis types, e.g. `auto_mesh(mesh)`) put on `mesh`
    itself with the same `PartitionSpec`; no data moves. Other leaves are
    returned as they are.
    """

    def one(x):
        s = getattr(x, "sharding", None) if isinstance(x, jax.Array) else None
        if (
            not isinstance(s, NamedSharding)
            or s.mesh == mesh
            or not isinstance(s.mesh, Mesh)
            or s.mesh.axis_names != mesh.axis_names
            or s.mesh.devices.shape != mesh.devices.shape
            or not (s.mesh.devices == mesh.devices).all()
        ):
            return x
        return jax.device_put(x, NamedSharding(mesh, s.spec, memory_kind=s.memory_kind))

    return jax.tree_util.tree_map(one, tree)


def param_shardings(
    model: Any, mesh: Any, rules: str | Rules, *, prefix: Sequence[str] = ()
) -> Any:
    """The `NamedSharding` of every array of `model` under `rules` (its structure).

    Raises:
        ConfigError: see `resolve_rules`; a dimension not divisible by the
            size of its mesh axes (naming the leaf, the axis and the mesh).
    """
    resolved = resolve_rules(rules, mesh)
    names = logical_axes(model, prefix=prefix)

    def one(path, x, spec):
        if not _is_leaf_array(x):
            return None
        key = jax.tree_util.keystr(path)
        return NamedSharding(mesh, _mesh_spec(spec, x.shape, resolved, mesh, key))

    return jax.tree_util.tree_map_with_path(
        one, model, names, is_leaf=lambda x: x is None
    )


@dataclasses.dataclass(frozen=True)
class ActivationConstraint:
    """`with_sharding_constraint` of the hidden state `(..., B, T, d)` (hashable).

    The last three dimensions get the mesh axes of `batch`, `seq`,
    `act_embed`; leading ones (none, or a vmapped member axis) are left to
    GSPMD. A single sequence `(T, d)` gets those of `seq`, `act_embed`.
    It guides propagation, so it names `Auto` axes: under a context mesh of
    the same axes (`jax.set_mesh`, as training sets; inside
    `jax.sharding.auto_axes`, the region's `Auto` view of it) the spec is
    resolved against that mesh, otherwise it is placed on `auto_mesh(mesh)`.
    A hidden state whose type carries `Explicit` axes (a forward outside
    `auto_axes` on a mesh with such axes) is refused with a `ConfigError`.
    """

    mesh: Any
    batch: tuple[str, ...] = ()
    seq: tuple[str, ...] = ()
    embed: tuple[str, ...] = ()

    @staticmethod
    def of(rules: Mapping[str, tuple[str, ...]], mesh: Any) -> ActivationConstraint:
        return ActivationConstraint(
            mesh,
            tuple(rules.get("batch", ())),
            tuple(rules.get("seq", ())),
            tuple(rules.get("act_embed", ())),
        )

    def __call__(self, h: jax.Array) -> jax.Array:
        def ax(a):
            return None if not a else a[0] if len(a) == 1 else a

        dims = [ax(self.seq), ax(self.embed)]
        if h.ndim >= 3:
            dims = [ax(self.batch), *dims]
        lead = [PartitionSpec.UNCONSTRAINED] * (h.ndim - len(dims))
        spec = PartitionSpec(*lead, *dims)
        typed = jax.typeof(h).sharding.mesh
        explicit = [
            n for n, t in zip(typed.axis_names, typed.axis_types, strict=True)
            if t == AxisType.Explicit
        ]  # fmt: skip
        if explicit:
            raise ConfigError(
                f"shard: the hidden state's layout is typed by the Explicit mesh "
                f"axes {explicit} (JAX's explicit sharding), but blocklab's modules "
                "propagate layouts; run the forward inside jax.sharding.auto_axes "
                "(see blocklab.shard); train_model and train_sweep compute on the "
                "mesh with those axes Auto themselves."
            )
        # A constraint for propagation, so on Auto axes: under a context mesh
        # of these axes (jax.set_mesh; inside jax.sharding.auto_axes, its Auto
        # view) the spec is resolved against it, as a program that holds a
        # callback (an id check) needs one mesh throughout; otherwise on the
        # mesh's Auto view.
        context = jax.sharding.get_abstract_mesh()
        if not context.empty and (context.axis_names, context.axis_sizes) == (
            tuple(self.mesh.axis_names),
            tuple(self.mesh.axis_sizes),
        ):
            return jax.lax.with_sharding_constraint(h, spec)
        sharding = NamedSharding(auto_mesh(self.mesh), spec)
        return jax.lax.with_sharding_constraint(h, sharding)


def with_constraints(model: Any, constraint: Any) -> Any:
    """`model` with `constraint` installed on every `Stack` in it
    (`Stack.with_constraint`: applied to the hidden state at block boundaries)."""

    def put(node):
        return node.with_constraint(constraint) if isinstance(node, Stack) else node

    return jax.tree_util.tree_map(put, model, is_leaf=lambda n: isinstance(n, Stack))


def place(x: Any, sharding: NamedSharding) -> Any:
    """`x` on `sharding`: an array is put there (on many processes, each builds
    its own shards from the same host value); a `jax.ShapeDtypeStruct` gets
    the sharding attached."""
    if isinstance(x, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
    if isinstance(x, jax.Array) and x.sharding == sharding:
        return x
    if jax.process_count() == 1 or (
        isinstance(x, jax.Array) and not x.is_fully_addressable
    ):
        return jax.device_put(x, sharding)
    host = np.asarray(x)  # the same on every process (built from the same key)
    return jax.make_array_from_callback(host.shape, sharding, lambda idx: host[idx])


def shard(
    model: Any,
    mesh: Mesh,
    rules: str | Rules = "fsdp",
    *,
    prefix: Sequence[str] = (),
    constrain_activations: bool = True,
) -> Any:
    r"""`model` with a `NamedSharding` on every array, laid out by `rules`.

    Array $x$ with logical axes $(n_1, \ldots, n_r)$ (`logical_axes`) is placed
    with `NamedSharding(mesh, PartitionSpec(rules[n_1], ..., rules[n_r]))`;
    each device holds $\prod_i D_i / |r(n_i)|$ of its elements. Shapes
    (`jax.ShapeDtypeStruct`, e.g. from `eqx.filter_eval_shape`) get the
    sharding attached instead, without allocating anything. Every `Stack`
    of the model constrains its hidden state at block boundaries to the
    `batch`/`seq`/`act_embed` rules (`constrain_activations=False`: not).

    On a mesh with `Explicit` axes (`jax.make_mesh`'s default) the arrays
    are laid out on that mesh, so their type carries the layout. The modules
    propagate layouts (GSPMD), so a forward of your own runs them inside
    `jax.sharding.auto_axes`, which makes those axes `Auto` for its region:

        with jax.set_mesh(mesh):
            forward = jax.sharding.auto_axes(
                lambda m, ids: jax.vmap(m)(ids), out_sharding=PartitionSpec()
            )
            logits = jax.jit(forward)(shard(model, mesh, "fsdp"), ids)

    (`train_model` and `train_sweep` compute on the mesh's `Auto` view by
    themselves.)

    Args:
        model: a blocklab model (see `logical_axes`).
        mesh: a `jax.sharding.Mesh` over every device; its axes `Auto`,
            `Explicit` or a mix.
        rules: a preset (`"fsdp"`, `"tp"`, `"ep"`, `"dp"`, joined by `+`)
            or a mapping logical name -> mesh axis / tuple / `None`.
        prefix: logical names of extra leading dimensions (`("members",)`).
        constrain_activations: install the block-boundary constraint.

    Raises:
        ConfigError: `mesh` is not a `Mesh`, or has a `Manual` axis; a rule
            naming a mesh axis that does not exist; a dimension not divisible
            by its mesh axis; a mesh whose device count differs from
            `jax.device_count()` (each naming the leaf or axis and the mesh).
    """
    check_mesh(mesh)
    shardings = param_shardings(model, mesh, rules, prefix=prefix)
    out = jax.tree_util.tree_map(
        lambda x, s: place(x, s) if s is not None else x,
        model,
        shardings,
        is_leaf=lambda x: x is None,
    )
    if constrain_activations:
        out = with_constraints(
            out, ActivationConstraint.of(resolve_rules(rules, mesh), mesh)
        )
    return out


def abstract_shard(model: Any, mesh: Any, rules: str | Rules = "fsdp") -> Any:
    """`shard` on shapes: `eqx.filter_eval_shape`'s model with shardings attached.

    Works with a `jax.sharding.AbstractMesh` (no devices needed), so a layout
    can be planned for a mesh this machine does not have.
    """
    shapes = jax.tree_util.tree_map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype) if eqx.is_array(x) else x,
        model,
    )
    shardings = param_shardings(shapes, mesh, rules)
    return jax.tree_util.tree_map(
        lambda x, s: place(x, s) if s is not None else x,
        shapes,
        shardings,
        is_leaf=lambda x: x is None,
    )


def mesh_of(
    spec: str | Mapping[str, int], devices: Sequence[Any] | None = None
) -> Mesh:
    """A mesh from `"data=8,model=4"` (or `{"data": 8, "model": 4}`) over `devices`.

    Raises:
        ConfigError: a malformed spec, or sizes whose product is not the
            number of devices.
    """
    shape = parse_mesh(spec)
    devices = jax.devices() if devices is None else list(devices)
    n = int(np.prod(list(shape.values())))
    if n != len(devices):
        raise ConfigError(
            f"mesh: {shape} has {n} devices but there are {len(devices)} "
            f"(jax.device_count() = {jax.device_count()})."
        )
    return Mesh(np.asarray(devices).reshape(tuple(shape.values())), tuple(shape))


def parse_mesh(spec: str | Mapping[str, int]) -> dict[str, int]:
    """`"data=8,model=4"` -> `{"data": 8, "model": 4}` (validated)."""
    if isinstance(spec, Mapping):
        items = list(spec.items())
    elif isinstance(spec, str):
        items = []
        for part in spec.split(","):
            name, eq, size = part.partition("=")
            if not eq or not name.strip() or not size.strip().isdigit():
                raise ConfigError(
                    f"mesh: must look like 'data=8,model=4' (axis=size, comma "
                    f"separated), got {spec!r}."
                )
            items.append((name.strip(), int(size)))
    else:
        raise ConfigError(f"mesh: must be 'data=8,model=4' or a dict, got {spec!r}.")
    out = {}
    for name, size in items:
        if (
            not isinstance(size, (int, np.integer))
            or isinstance(size, bool)
            or size < 1
        ):
            raise ConfigError(
                f"mesh: axis {name!r} needs an int size >= 1, got {size!r} "
                f"({type(size).__name__})."
            )
        if name in out:
            raise ConfigError(f"mesh: axis {name!r} is given twice in {spec!r}.")
        out[name] = int(size)
    if not out:
        raise ConfigError(f"mesh: give at least one axis, got {spec!r}.")
    return out
