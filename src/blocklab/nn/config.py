r"""`BlockConfig`: every option of a transformer block, frozen and validated once.

A block option lives here as one field, one check in `BlockConfig.__post_init__`
and one use where the block is built. The modules built from a config
(`TransformerBlock`, `MultiHeadAttention`, `FeedForward`) trust it and check
nothing again; their keyword spelling (`TransformerBlock(d, H, act="gelu")`)
builds the config (`as_config`), so a new option is one field, one check and
its one use, and reaches every module and `DecoderConfig` with no other edit.

The option tables (`PLACEMENTS`, `QK_NORMS`, `ACTS`, `GATED_ACTS`) and the
FFN width rule (`ffn_width`) sit here, below the modules that use them.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._validate import ConfigError, check_bool, check_choice, check_float, check_int
from .normalization import NORMS

__all__ = [
    "BlockConfig",
    "as_config",
    "check_option_names",
    "ATTENTION_IMPLS",
    "PLACEMENTS",
    "QK_NORMS",
    "ACTS",
    "GATED_ACTS",
    "ffn_width",
    "check_act",
    "WINDOW_MODES",
]

#: The valid values of the `attention_impl` option (`attention_impls` implements them).
ATTENTION_IMPLS = ("auto", "reference", "fused", "chunked")
#: The valid values of the `placement` option.
PLACEMENTS = ("post", "pre", "output", "sandwich")
#: The valid values of the `qk_norm` option (`True` means `"head"`).
QK_NORMS = (False, True, "head", "full")
#: The valid values of the `act` option (ungated first, then gated).
ACTS = (
    "relu", "gelu", "gelu_exact", "swiglu", "geglu", "reglu", "bilinear",
    "geglu_exact",
)  # fmt: skip
#: The gated settings (three matrices).
GATED_ACTS = ("swiglu", "geglu", "reglu", "bilinear", "geglu_exact")
#: The valid values of the `window_mode` option.
WINDOW_MODES = ("causal", "bidirectional")


def _check_sizes(
    owner: str,
    num_hiddens: Any,
    num_heads: Any,
    *,
    num_kv_heads: Any = None,
    head_dim: Any = None,
) -> tuple[int, int, int, int]:
    r"""Validate the attention sizes; return $(d, H, K, p)$ resolved.

    $d$ and $H$ are positive ints; $K$ (default $H$) divides $H$; $p$ is
    `head_dim`, or $d / H$, which then must be an integer.
    """
    head_dim = check_int(owner, "head_dim", head_dim, min=1, optional=True)
    sizes = []
    for name, value in (("num_hiddens", num_hiddens), ("num_heads", num_heads)):
        value = check_int(owner, name, value)
        if value < 1:
            raise ConfigError(f"{owner}: {name} must be a positive int, got {value!r}.")
        sizes.append(value)
    d, H = sizes
    if head_dim is None and d % H:
        raise ConfigError(
            f"{owner}: num_hiddens must be divisible by num_heads, got "
            f"num_hiddens={d}, num_heads={H}; choose num_heads among the divisors "
            f"of {d}, or give head_dim explicitly."
        )
    K = check_int(owner, "num_kv_heads", num_kv_heads, min=1, optional=True)
    K = H if K is None else K
    if H % K:
        raise ConfigError(
            f"{owner}: num_kv_heads must divide num_heads, got num_kv_heads={K}, "
            f"num_heads={H}; choose num_kv_heads among the divisors of {H}."
        )
    return d, H, K, d // H if head_dim is None else head_dim


def _check_dropout(owner: str, dropout: Any) -> float:
    """Return `dropout` as a Python float in [0, 1)."""
    dropout = check_float(owner, "dropout", dropout)
    if not 0.0 <= dropout < 1.0:
        raise ConfigError(
            f"{owner}: dropout must be in [0, 1), got dropout={dropout!r}."
        )
    return dropout


def _check_qk_norm(owner: str, qk_norm: Any) -> bool | str:
    """`False` -> `False`, `True` / `"head"` -> `"head"`, `"full"` -> `"full"`."""
    if isinstance(qk_norm, (bool, np.bool_)):
        return "head" if qk_norm else False
    if isinstance(qk_norm, str) and qk_norm in ("head", "full"):
        return qk_norm
    raise ConfigError(
        f"{owner}: qk_norm must be one of {list(QK_NORMS)}, got qk_norm={qk_norm!r}."
    )


def _check_rope(owner: str, rope_theta: Any, head_dim: int) -> float | None:
    """Return the RoPE base as a float > 0 (or `None`); it needs an even `head_dim`."""
    rope_theta = check_float(
        owner, "rope_theta", rope_theta, min=0.0, min_open=True, optional=True
    )
    if rope_theta is not None and head_dim % 2:
        raise ConfigError(
            f"{owner}: RoPE needs an even head_dim, got head_dim={head_dim} "
            f"(rope_theta={rope_theta})."
        )
    return rope_theta


def check_act(owner: str, act: Any) -> str:
    """Return `act` if it is one of `ACTS` (case-sensitive)."""
    return check_choice(owner, "act", act, ACTS)


def ffn_width(num_hiddens: int, act: str, multiple_of: int | None = None) -> int:
    r"""Hidden width of the FFN for `act`.

    Ungated: $4d$. Gated (three matrices): $\mathrm{round}(8d/3)$, which
    matches the $8d^2$ budget of the ungated MLP. With `multiple_of=m` the
    Llama rule applies: the smallest multiple of $m$ not below $\lfloor 8d/3
    \rfloor$ (gated) or $4d$ (ungated); $d = 4096, m = 256$ gives 11008.
    """
    check_act("ffn_width", act)
    num_hiddens = check_int("ffn_width", "num_hiddens", num_hiddens, min=1)
    gated = act in GATED_ACTS
    if multiple_of is None:
        return round(8 * num_hiddens / 3) if gated else 4 * num_hiddens
    multiple_of = check_int("ffn_width", "multiple_of", multiple_of)
    if multiple_of < 1:
        raise ConfigError(
            f"ffn_width: multiple_of must be a positive int, got {multiple_of!r}."
        )
    base = (8 * num_hiddens) // 3 if gated else 4 * num_hiddens
    return -(-base // multiple_of) * multiple_of


class ComparedByKey:
    """`==` and `hash` of a frozen config by its `_key()`: what makes two
    configs build the same thing (`BlockConfig`, `DecoderConfig`)."""

    def _key(self) -> tuple:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ComparedByKey):
            return NotImplemented
        return self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())


class HoldsBlock(ComparedByKey):
    """A model config that holds one `BlockConfig` as `block` and reads its
    fields through (`cfg.num_hiddens` is `cfg.block.num_hiddens`)."""

    def _key(self) -> tuple:
        # Every field, and the block's per-layer data by value: two models
        # differ when their windows or RoPE bases do (the block alone compares
        # only their presence, so that the layers of one stack share it).
        fields = (getattr(self, f.name) for f in dataclasses.fields(self))
        return (type(self), *fields, self.block.window, self.block.rope_theta)

    def __getattr__(self, name: str) -> Any:
        # Called only for names that are not the config's own: the block's
        # fields read through (one value per field, no copies).
        if name.startswith("_") or name == "block":
            raise AttributeError(name)
        block = self.__dict__.get("block")
        if block is not None and name in {f.name for f in dataclasses.fields(block)}:
            return getattr(block, name)
        raise AttributeError(
            f"{type(self).__name__} has no attribute {name!r} (neither its own "
            "field nor one of its block's)."
        )

    def _init(
        self, vocab_size, num_hiddens, num_heads, num_blks, block, options, owner=None
    ) -> None:
        """Set the fields: split `options` into the model's own fields (those
        of every dataclass of its class) and the block's; build the block
        (`owner` names the config in the errors)."""
        names_owner = type(self).__name__
        owner = owner or names_owner
        own = {
            f.name
            for c in type(self).__mro__
            if dataclasses.is_dataclass(c)
            for f in dataclasses.fields(c)
        }
        model = {k: v for k, v in options.items() if k in own}
        block_options = {k: v for k, v in options.items() if k not in own}
        if num_blks is None:
            raise ConfigError(f"{owner}: num_blks is required (the depth).")
        if isinstance(block, Mapping):
            block = BlockConfig(**block)
        if block is None:
            if num_hiddens is None or num_heads is None:
                raise ConfigError(
                    f"{owner}: give num_hiddens and num_heads (the block's options "
                    "as keywords), or block=BlockConfig(...)."
                )
            check_option_names(names_owner, block_options, beside=tuple(own))
            block = BlockConfig(num_hiddens, num_heads, **block_options)
        elif not isinstance(block, BlockConfig):
            raise ConfigError(
                f"{owner}: block must be a BlockConfig, got {type(block).__name__}."
            )
        else:
            for name, value in (("num_hiddens", num_hiddens), ("num_heads", num_heads)):
                if value is not None:
                    block_options[name] = value
            if block_options:
                check_option_names(names_owner, block_options, beside=tuple(own))
                block = dataclasses.replace(block, **block_options)
        defaults = {
            f.name: f.default
            for f in dataclasses.fields(type(self))
            if f.default is not dataclasses.MISSING
        }
        values = {**defaults, **model}
        values.update(vocab_size=vocab_size, num_blks=num_blks, block=block)
        for name, value in values.items():
            object.__setattr__(self, name, value)

    def _fields_dict(self) -> dict[str, Any]:
        """The model's own fields, with `block` as a dict."""
        out = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name != "block"
        }
        out["block"] = self.block.to_dict()
        return out


class LayerSchedule:
    """Per-layer attention of a stack of one block: layer $i$ is global when
    the block has no window or $i$ is in `global_layers`, local (window $w$,
    RoPE base `local_rope_theta`) otherwise. Needs `block`, `num_blks`,
    `global_layers`, `positions` and `local_rope_theta`."""

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends to every position (every earlier one
        in a decoder)."""
        if self.block.window is None:
            return True
        return self.global_layers is not None and layer in self.global_layers

    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer window (0 = global attention)."""
        w = self.block.window
        return tuple(0 if self.is_global(i) else w for i in range(self.num_blks))

    def layer_thetas(self) -> tuple[float, ...] | None:
        """Per-layer RoPE base (`None` without RoPE, as with learned positions)."""
        if self.positions != "rope":
            return None
        theta = self.block.rope_theta
        local = theta if self.local_rope_theta is None else self.local_rope_theta
        return tuple(
            theta if self.is_global(i) else local for i in range(self.num_blks)
        )


def check_global_layers(
    owner: str, layers: Any, window: int | None, num_blks: int
) -> tuple[int, ...] | None:
    """Return `global_layers` as a sorted tuple of unique layer indices in
    $[0, N)$ (`None` stays `None`); it needs a window (the other layers are
    local)."""
    if layers is None:
        return None
    if window is None:
        raise ConfigError(
            f"{owner}: global_layers={layers!r} needs a window (the other "
            "layers are local); set window or drop global_layers."
        )
    if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
        raise ConfigError(
            f"{owner}: global_layers must be a sequence of layer indices, "
            f"got {layers!r}."
        )
    idx = tuple(
        check_int(owner, "global_layers[i]", i, min=0, max=num_blks - 1) for i in layers
    )
    if list(idx) != sorted(set(idx)):
        raise ConfigError(
            f"{owner}: global_layers must be sorted and unique, got {layers!r}."
        )
    return idx


@dataclasses.dataclass(frozen=True, eq=False)
class BlockConfig(ComparedByKey):
    r"""Every option of a `TransformerBlock`, validated once, when built.

    Frozen and hashable (a static field of the block). The constructor checks
    each field (a `ConfigError` names the field, the value and the valid
    choices) and stores the derived ones resolved, so two configs that build
    the same block compare equal: `num_kv_heads` ($K$, default $H$),
    `head_dim` ($p$, default $d/H$), `ffn_width` (default
    `ffn_width(d, act)`), `attn_bias` and `ffn_bias` (default `bias`) and
    `qk_norm` (`False`, `"head"` or `"full"`; `True` becomes `"head"`).
    `dataclasses.replace(cfg, ...)` validates again and keeps the resolved
    values; pass `head_dim=None` (say) to derive one anew.

    `rope_theta` and `window` are data, not structure: the attention stores
    them as integer leaves, so the layers of one `Stack` (Gemma 3's local and
    global layers) can differ in them. Their values are left out of `==` and
    `hash`, so that such layers share one static config; whether RoPE or a
    window is present at all is structure (the module has the leaf or not),
    and is compared. (Do not rely on a config as a `jit` static argument to
    carry their values.)

    Attributes:
        num_hiddens: model width $d$.
        num_heads: query heads $H$; must divide $d$ unless `head_dim` is given.
        dropout: rate on the attention weights and both branch outputs, in [0, 1).
        norm: `"rms"`, `"layer"` or `"gemma_rms"` (RMSNorm with gain $1 + w$).
        act: the FFN activation, one of `ACTS`.
        placement: norm placement, one of `PLACEMENTS`.
        bias: the default of `attn_bias` and `ffn_bias`.
        qk_norm: `False`, `True` / `"head"` (per-head RMSNorm of queries and
            keys) or `"full"` (over the whole projected width, OLMo 2).
        norm_eps: the $\epsilon$ of every norm of the block (QK-norms too).
        num_kv_heads: key/value heads $K$, dividing $H$ (grouped-query).
        head_dim: per-head width $p$.
        ffn_width: the FFN's hidden width.
        attn_scale: the attention logit multiplier, > 0 (`None`: $1/\sqrt p$).
        rope_theta: RoPE base $\theta$ > 0 (`None`: no RoPE); needs an even $p$.
        window: local attention over the last `window` positions (0 or `None`:
            global).
        attn_bias, ffn_bias: biases of the attention / FFN projections.
        attn_softcap: soft-cap $c > 0$ of the attention logits, $c \tanh(s/c)$
            (Gemma 2); `None`: none.
        attention_impl: `"auto"`, `"reference"`, `"fused"` or `"chunked"`
            (`MultiHeadAttention`; `trace` always uses the reference).
        attn_out_bias: a bias on the attention's output projection $W_o$
            (default `attn_bias`; Qwen 2 has biases on $W_q, W_k, W_v$ only).
        window_mode: `"causal"` (key $k$ in the window of query $q$ iff
            $q - w < k \le q$) or `"bidirectional"` (iff $|q - k| < w$:
            an encoder's local layers; ModernBERT's `local_attention` $a$ is
            $w = a/2 + 1$).
        cross_attention: the block gets a cross-attention branch (keys and
            values from an encoder's output) between its self-attention and
            its FFN (`TransformerBlock`); structure, so an encoder and a
            decoder are two stacks.
        skip_attn_norm: the block carries an integer leaf `skip_norm1`
            (data, per layer of a stack): where it is 1 the self-attention
            reads the stream itself instead of `norm1` of it (ModernBERT's
            first layer); `"pre"` and `"sandwich"` placements only.
    """

    num_hiddens: int
    num_heads: int
    dropout: float = 0.0
    norm: str = "rms"
    act: str = "swiglu"
    placement: str = "pre"
    bias: bool = False
    qk_norm: bool | str = False
    norm_eps: float = 1e-6
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_width: int | None = None
    attn_scale: float | None = None
    # Data, not structure: only their presence is compared (see `_key`).
    rope_theta: float | None = dataclasses.field(default=None, compare=False)
    window: int | None = dataclasses.field(default=None, compare=False)
    attn_bias: bool | None = None
    ffn_bias: bool | None = None
    attn_out_bias: bool | None = None
    attn_softcap: float | None = None
    attention_impl: str = "auto"
    window_mode: str = "causal"
    cross_attention: bool = False
    skip_attn_norm: bool = False

    def __post_init__(self):
        owner = "BlockConfig"

        def put(name, value):
            object.__setattr__(self, name, value)

        d, H, K, p = _check_sizes(
            owner,
            self.num_hiddens,
            self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        for name, value in (
            ("num_hiddens", d), ("num_heads", H), ("num_kv_heads", K), ("head_dim", p)
        ):  # fmt: skip
            put(name, value)
        put("dropout", _check_dropout(owner, self.dropout))
        put("norm", check_choice(owner, "norm", self.norm, sorted(NORMS)))
        put("act", check_act(owner, self.act))
        put("placement", check_choice(owner, "placement", self.placement, PLACEMENTS))
        put("bias", check_bool(owner, "bias", self.bias))
        for name in ("attn_bias", "ffn_bias"):
            value = getattr(self, name)
            put(name, self.bias if value is None else check_bool(owner, name, value))
        value = self.attn_out_bias
        put(
            "attn_out_bias",
            self.attn_bias
            if value is None
            else check_bool(owner, "attn_out_bias", value),
        )
        put("qk_norm", _check_qk_norm(owner, self.qk_norm))
        put("norm_eps", check_float(owner, "norm_eps", self.norm_eps, min=0.0))
        width = check_int(owner, "ffn_width", self.ffn_width, min=1, optional=True)
        put("ffn_width", ffn_width(d, self.act) if width is None else width)
        scale = self.attn_scale
        put(
            "attn_scale",
            check_float(
                owner, "attn_scale", scale, min=0.0, min_open=True, optional=True
            ),
        )
        put("rope_theta", _check_rope(owner, self.rope_theta, p))
        put("window", check_int(owner, "window", self.window, min=0, optional=True))
        put(
            "attn_softcap",
            check_float(
                owner, "attn_softcap", self.attn_softcap, min=0.0, min_open=True,
                optional=True,
            ),
        )  # fmt: skip
        put(
            "attention_impl",
            check_choice(owner, "attention_impl", self.attention_impl, ATTENTION_IMPLS),
        )
        put(
            "window_mode",
            check_choice(owner, "window_mode", self.window_mode, WINDOW_MODES),
        )
        put(
            "cross_attention",
            check_bool(owner, "cross_attention", self.cross_attention),
        )
        put("skip_attn_norm", check_bool(owner, "skip_attn_norm", self.skip_attn_norm))
        if self.skip_attn_norm and self.placement not in ("pre", "sandwich"):
            raise ConfigError(
                f"{owner}: skip_attn_norm=True needs a placement whose branch reads "
                f"the normed stream ('pre' or 'sandwich'), got "
                f"placement={self.placement!r}."
            )

    def _key(self) -> tuple:
        """What `==` and `hash` compare: every field but the values of the
        per-layer data (`rope_theta`, `window`), and whether each is set."""
        return (
            type(self),
            *(getattr(self, f.name) for f in dataclasses.fields(self) if f.compare),
            self.rope_theta is None,
            self.window is None,
        )

    @property
    def gated(self) -> bool:
        """Whether the FFN is gated (three matrices)."""
        return self.act in GATED_ACTS

    @property
    def scale(self) -> float:
        r"""The attention logit multiplier: `attn_scale`, or $1/\sqrt p$."""
        return (
            1.0 / math.sqrt(self.head_dim)
            if self.attn_scale is None
            else self.attn_scale
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields (resolved), as `BlockConfig(**d)` takes them back."""
        return dataclasses.asdict(self)


def check_option_names(
    owner: str, options: Mapping[str, Any], *, beside: tuple[str, ...] = ()
) -> None:
    """Refuse a keyword that is not a field of `BlockConfig` (nor one of the
    caller's own fields, `beside`): a `TypeError` naming it and the fields."""
    fields = {f.name for f in dataclasses.fields(BlockConfig)}
    unknown = sorted(set(options) - fields - set(beside))
    if unknown:
        names = ", ".join(sorted(fields - {"num_hiddens", "num_heads"}))
        own = f"{owner}'s fields ({', '.join(sorted(beside))}) and " if beside else ""
        raise TypeError(
            f"{owner}: unknown option {unknown[0]!r}; the options are {own}the "
            f"fields of BlockConfig: {names}."
        )


def as_config(
    owner: str,
    num_hiddens: Any,
    num_heads: Any,
    options: Mapping[str, Any],
    *,
    default_heads: int | None = None,
) -> BlockConfig:
    """The `BlockConfig` a module is built from: the one given, or built here.

    This is how the keyword spelling of every module reaches the one
    declaration of its options: `TransformerBlock(d, H, act="gelu")` is
    `TransformerBlock(BlockConfig(d, H, act="gelu"))`, and likewise for
    `MultiHeadAttention` and `FeedForward` (whose `num_heads` defaults to
    `default_heads`). Given a `BlockConfig` (of any subclass), nothing else
    may be passed beside it; an option that is not a field of `BlockConfig`
    raises `TypeError` naming it and the fields.
    """
    if isinstance(num_hiddens, BlockConfig):
        given = dict(options)
        if num_heads is not None:
            given["num_heads"] = num_heads
        if given:
            raise ConfigError(
                f"{owner}: the BlockConfig carries every option, got "
                f"{', '.join(f'{k}={v!r}' for k, v in given.items())} beside it; "
                "set it in the config instead (dataclasses.replace(cfg, ...))."
            )
        return num_hiddens
    check_option_names(owner, options)
    if num_heads is None:
        num_heads = default_heads
    if num_heads is None:
        raise ConfigError(
            f"{owner}: give num_heads beside num_hiddens, or a BlockConfig "
            f"alone; got num_hiddens={num_hiddens!r} and no num_heads."
        )
    try:
        return BlockConfig(num_hiddens, num_heads, **options)
    except ConfigError as err:  # name the module the user called
        message = str(err).removeprefix("BlockConfig: ")
        raise ConfigError(f"{owner}: {message}") from None


def replace_static(
    model: Any, name: str, value: Any, target: Callable[[Any], bool]
) -> tuple[Any, list[Any]]:
    """`model` with the static field `name` set to `value` on every module
    that `target` accepts, and on every static config (a dataclass) that has
    a field `name` (`BlockConfig`, `DecoderConfig`), so that a saved config
    rebuilds the changed model; the arrays are shared, not copied. Returns
    `(new_model, changed)`, `changed` the target modules (as found)."""
    found: list[Any] = []

    def is_module(node):
        return isinstance(node, eqx.Module)

    def walk(node):
        if not is_module(node):
            return node
        new = copy.copy(node)
        for f in dataclasses.fields(node):
            if not hasattr(node, f.name):
                continue
            v = getattr(node, f.name)
            if f.metadata.get("static", False):
                if f.name == name and target(node):
                    found.append(node)
                    v = value
                elif (
                    dataclasses.is_dataclass(v)
                    and not isinstance(v, type)
                    and name in {g.name for g in dataclasses.fields(v)}
                ):
                    v = dataclasses.replace(v, **{name: value})
            else:
                v = jax.tree_util.tree_map(walk, v, is_leaf=is_module)
            object.__setattr__(new, f.name, v)
        return new

    return jax.tree_util.tree_map(walk, model, is_leaf=is_module), found
