r"""A general decoder-only language model: `DecoderConfig` and `DecoderLM`.

One class covers GPT-2, Llama, OLMo 2 and Gemma 3 (and the many models that
differ from them only in sizes): a token embedding (optionally scaled), learned
absolute positions or rotary positions, a `Stack` of `TransformerBlock`s run as
one `lax.scan`, a final norm and a tied or untied head. Layers that differ
(Gemma 3's local and global layers, with their own RoPE base) differ only in
data stored in the stacked pytree (the attention's integer `window` and
`rope_theta` leaves), never in structure, so compile time stays flat in depth.

`blocklab.from_huggingface` converts the `transformers` PyTorch models of these
families into a `DecoderLM`; the presets `DecoderConfig.gpt2`, `.llama`,
`.olmo2` and `.gemma3` build small models of each family without `torch`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import (
    ConfigError,
    check_bool,
    check_choice,
    check_float,
    check_ids,
    check_int,
    check_key,
)
from . import cache as _cache
from . import init, parametrization
from .attention import check_segment_ids
from .block import TransformerBlock
from .config import QK_NORMS, BlockConfig
from .functional import causal_lengths, linear, segment_positions
from .normalization import LayerNorm, RMSNorm
from .stack import Stack

__all__ = ["DecoderConfig", "DecoderLM", "DECODER_NORMS", "QK_NORMS", "set_layer_data"]

#: The valid values of `DecoderConfig.norm`.
DECODER_NORMS = ("rms", "layer", "gemma_rms")
_OWNER = "DecoderConfig"

#: What Llama and OLMo 2 share: RMSNorm, SwiGLU, RoPE (theta 1e4), untied head.
_LLAMA_FAMILY = dict(
    act="swiglu", norm="rms", positions="rope", rope_theta=10000.0,
    tie_embeddings=False,
)  # fmt: skip


#: `DecoderConfig` and its subclasses by name, so `DecoderLM.config()` can
#: name the class a checkpoint must rebuild (e.g. `MoEDecoderConfig`).
CONFIG_CLASSES: dict[str, type] = {}


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    r"""The hyperparameters of a `DecoderLM` (frozen, hashable, validated).

    Attributes:
        vocab_size: number of token ids $V$.
        num_hiddens: model width $d$.
        num_heads: query heads $H$.
        num_blks: depth $N$ (number of blocks).
        num_kv_heads: key/value heads $K$ ($H$ divisible by $K$); query head
            $i$ reads kv head $i // (H/K)$. `None`: $K = H$ (multi-head);
            $1$ is multi-query.
        head_dim: per-head width $p$; `None`: $d / H$.
        ffn_width: FFN hidden width; `None`: `blocklab.ffn_width(d, act)`.
        act: FFN activation, one of `blocklab.ACTS` (`"gelu"` is the tanh
            GELU of GPT-2; `"swiglu"` Llama / OLMo 2; `"geglu"` Gemma 3).
        norm: `"rms"`, `"layer"` (LayerNorm with bias) or `"gemma_rms"`
            (RMSNorm with gain $1 + w$, $w$ initialized at 0), for every norm
            of the model: the blocks', the QK-norm and the final norm.
        norm_eps: the $\epsilon$ of every norm.
        placement: norm placement in the blocks, one of `blocklab.PLACEMENTS`
            (`"pre"` GPT-2 / Llama, `"output"` OLMo 2, `"sandwich"` Gemma 3).
        attn_bias: biases on the four attention projections.
        ffn_bias: biases on the FFN's linear layers.
        qk_norm: `False`; `True` or `"head"` (normalize each query/key head
            over its $p$ features with one gain shared by the heads, Gemma 3);
            `"full"` (normalize the projected queries over all $H p$ and keys
            over all $K p$ features before the split into heads, OLMo 2).
        positions: `"learned"` (absolute position embedding added to the token
            embedding, GPT-2) or `"rope"` (rotary, half-split convention,
            applied to queries and keys in every layer).
        max_len: longest sequence; the rows of the learned position table.
            With RoPE it only bounds the inputs `DecoderLM` accepts.
        rope_theta: RoPE base $\theta$ of the global layers (`"rope"` only;
            default 10000).
        local_rope_theta: RoPE base of the local (windowed) layers; `None`:
            `rope_theta`. Gemma 3: 10000 local, 1e6 global.
        window: sliding-window length $w$ of the local layers (key $k$ is
            visible from query $q$ when $q - w < k \le q$); `None`: no layer
            is local.
        global_layers: 0-based indices of the layers with global attention
            when `window` is set (Gemma 3: every sixth, 5, 11, ...); `None`:
            every layer is local. Sorted, unique.
        attn_scale: the factor on $q \cdot k$ before the softmax; `None`:
            $1/\sqrt p$. Gemma 3: `query_pre_attn_scalar ** -0.5`.
        embed_scale: factor on the token embedding, applied in the embedding's
            dtype (Gemma 3: $\sqrt d$); `None`: no scaling.
        tie_embeddings: the head reuses the token embedding ($E^\top$);
            `False` gives the model its own `head` matrix.
        attn_out_bias: a bias on the attention's output projection $W_o$;
            `None`: `attn_bias` (Qwen 2: biases on $W_q, W_k, W_v$ only).
        final_softcap: final-logit soft-capping $c$: the logits $z$ become
            $c \tanh(z / c)$ (float32; Gemma 2: 30); `None`: no capping.
        attn_softcap: attention-logit soft-capping $c$ in every block: the
            scaled scores $s$ become $c \tanh(s / c)$ before the mask (Gemma
            2: 50); `None`: no capping.
        parametrization: `"standard"` or `"mup"` (see
            `blocklab.nn.parametrization`: under μP the query projection and
            an untied head start at zero, the logits are multiplied by
            $d_0/d$ and the attention scale is $\sqrt{p_0}/p$ unless
            `attn_scale` is given; `blocklab.optimizer` applies the rates).
        base_width: the width $d_0$ at which μP equals standard (required by
            `"mup"`; every width must scale to an integer at $d_0$).
        attention_impl: `"auto"` (default), `"reference"`, `"fused"` or
            `"chunked"`, every layer's (`MultiHeadAttention`;
            `blocklab.with_attention_impl` switches a built model).
    """

    vocab_size: int
    num_hiddens: int
    num_heads: int
    num_blks: int
    num_kv_heads: int | None = None
    head_dim: int | None = None
    ffn_width: int | None = None
    act: str = "swiglu"
    norm: str = "rms"
    norm_eps: float = 1e-6
    placement: str = "pre"
    attn_bias: bool = False
    ffn_bias: bool = False
    qk_norm: bool | str = False
    positions: str = "rope"
    max_len: int = 2048
    rope_theta: float | None = None
    local_rope_theta: float | None = None
    window: int | None = None
    global_layers: tuple[int, ...] | None = None
    attn_scale: float | None = None
    embed_scale: float | None = None
    tie_embeddings: bool = True
    attn_out_bias: bool | None = None
    final_softcap: float | None = None
    attn_softcap: float | None = None
    parametrization: str = "standard"
    base_width: int | None = None
    attention_impl: str = "auto"

    def __post_init__(self):
        """Check the model's own fields here and the block's in `BlockConfig`
        (built once, as `self.block`), so each rule is written once."""

        def put(name, value):
            object.__setattr__(self, name, value)

        for name in ("vocab_size", "num_blks", "max_len"):
            put(name, check_int(_OWNER, name, getattr(self, name), min=1))
        put(
            "positions",
            check_choice(_OWNER, "positions", self.positions, ("learned", "rope")),
        )
        put(
            "embed_scale",
            check_float(
                _OWNER, "embed_scale", self.embed_scale, min=0.0, min_open=True,
                optional=True,
            ),
        )  # fmt: skip
        put("tie_embeddings", check_bool(_OWNER, "tie_embeddings", self.tie_embeddings))
        put(
            "final_softcap",
            check_float(
                _OWNER, "final_softcap", self.final_softcap, min=0.0, min_open=True,
                optional=True,
            ),
        )  # fmt: skip
        rope = self.positions == "rope"
        for name in ("rope_theta", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not rope:
                raise ConfigError(
                    f"{_OWNER}: {name}={value!r} needs positions='rope', got "
                    f"positions={self.positions!r}."
                )
            put(
                name,
                check_float(_OWNER, name, value, min=1.0, min_open=True, optional=True),
            )
        if rope and self.rope_theta is None:
            put("rope_theta", 10000.0)
        put("window", check_int(_OWNER, "window", self.window, min=1, optional=True))
        layers = self.global_layers
        if layers is not None:
            if self.window is None:
                raise ConfigError(
                    f"{_OWNER}: global_layers={layers!r} needs a window (the other "
                    "layers are local); set window or drop global_layers."
                )
            if isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__"):
                raise ConfigError(
                    f"{_OWNER}: global_layers must be a sequence of layer indices, "
                    f"got {layers!r}."
                )
            idx = tuple(
                check_int(_OWNER, "global_layers[i]", i, min=0, max=self.num_blks - 1)
                for i in layers
            )
            if list(idx) != sorted(set(idx)):
                raise ConfigError(
                    f"{_OWNER}: global_layers must be sorted and unique, got "
                    f"{layers!r}."
                )
            put("global_layers", idx)
        if self.local_rope_theta is not None and self.window is None:
            raise ConfigError(
                f"{_OWNER}: local_rope_theta={self.local_rope_theta!r} needs local "
                "layers; set window (and global_layers)."
            )
        self._check_parametrization(put)
        thetas, windows = self.layer_thetas(), self.layer_windows()
        block = BlockConfig(
            self.num_hiddens,
            self.num_heads,
            norm=self.norm,
            act=self.act,
            placement=self.placement,
            qk_norm=self.qk_norm,
            norm_eps=self.norm_eps,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            ffn_width=self.ffn_width,
            attn_scale=self.attn_scale,
            # Built with the first layer's values; `set_layer_data` writes
            # every layer's (they are data in the stacked pytree).
            rope_theta=None if thetas is None else thetas[0],
            window=None if self.window is None else windows[0],
            attn_bias=self.attn_bias,
            ffn_bias=self.ffn_bias,
            attn_out_bias=self.attn_out_bias,
            attn_softcap=self.attn_softcap,
            attention_impl=self.attention_impl,
        )
        object.__setattr__(self, "_block", block)
        # The block's checked values, as Python numbers; the optional sizes
        # stay `None` when not given (the defaults follow the other fields).
        for name in ("num_hiddens", "num_heads", "norm", "act", "placement"):
            put(name, getattr(block, name))
        for name in ("norm_eps", "attn_scale", "attn_bias", "ffn_bias"):
            put(name, getattr(block, name))
        put("attn_softcap", block.attn_softcap)
        put("attention_impl", block.attention_impl)
        if self.attn_out_bias is not None:
            put("attn_out_bias", block.attn_out_bias)
        for name in ("num_kv_heads", "head_dim", "ffn_width"):
            if getattr(self, name) is not None:
                put(name, getattr(block, name))

    def _check_parametrization(self, put) -> None:
        """`parametrization` / `base_width`, and μP's attention scale."""
        d, H = self.num_hiddens, self.num_heads
        if not all(
            isinstance(v, int) and not isinstance(v, bool) and v >= 1
            for v in (d, H)
        ) or (self.head_dim is None and d % H):
            return  # BlockConfig names the bad size
        p = d // H if self.head_dim is None else self.head_dim
        sizes = {"head_dim": p}
        if isinstance(self.ffn_width, int):
            sizes["ffn_width"] = self.ffn_width
        name, base = parametrization.check_base_width(
            _OWNER, self.parametrization, self.base_width, d, sizes
        )
        put("parametrization", name)
        put("base_width", base)
        if name == "mup" and self.attn_scale is None and isinstance(p, int) and p > 0:
            put("attn_scale", parametrization.attention_scale(name, p, d, base))

    @property
    def readout_multiplier(self) -> float:
        """The factor on the logits: 1, or $d_0/d$ under μP."""
        return parametrization.readout_multiplier(
            self.parametrization, self.num_hiddens, self.base_width
        )

    @property
    def block(self) -> BlockConfig:
        """The `BlockConfig` of the layers (built and checked with this config).

        Its `window` and `rope_theta` are the first layer's; each layer's own
        are data in the stacked attention (`layer_windows`, `layer_thetas`).
        """
        return self._block

    # Derived sizes ---------------------------------------------------------

    @property
    def kv_heads_(self) -> int:
        """Deprecated: `cfg.block.num_kv_heads` (the resolved kv head count)."""
        _warn_resolved("kv_heads_", "num_kv_heads")
        return self.block.num_kv_heads

    @property
    def head_dim_(self) -> int:
        """Deprecated: `cfg.block.head_dim` (the resolved per-head width)."""
        _warn_resolved("head_dim_", "head_dim")
        return self.block.head_dim

    def is_global(self, layer: int) -> bool:
        """Whether layer `layer` attends to every earlier position."""
        if self.window is None:
            return True
        return self.global_layers is not None and layer in self.global_layers

    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer window (0 = global attention)."""
        return tuple(
            0 if self.is_global(i) else self.window for i in range(self.num_blks)
        )

    def layer_thetas(self) -> tuple[float, ...] | None:
        """Per-layer RoPE base (`None` with learned positions)."""
        if self.positions != "rope":
            return None
        local = (
            self.rope_theta if self.local_rope_theta is None else self.local_rope_theta
        )
        return tuple(
            self.rope_theta if self.is_global(i) else local
            for i in range(self.num_blks)
        )

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        CONFIG_CLASSES[cls.__name__] = cls

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-friendly values (tuples as lists)."""
        out = dataclasses.asdict(self)
        if out["global_layers"] is not None:
            out["global_layers"] = list(out["global_layers"])
        return out

    # Presets (small defaults; no torch needed) -----------------------------

    @classmethod
    def gpt2(
        cls,
        vocab_size: int = 128,
        num_hiddens: int = 64,
        num_heads: int = 4,
        num_blks: int = 2,
        *,
        max_len: int = 128,
        **overrides: Any,
    ) -> DecoderConfig:
        """GPT-2: pre-LN LayerNorm (eps 1e-5), tanh-GELU MLP of width 4d with
        biases everywhere, learned positions, tied head."""
        fields = dict(
            act="gelu",
            norm="layer",
            norm_eps=1e-5,
            placement="pre",
            attn_bias=True,
            ffn_bias=True,
            positions="learned",
            max_len=max_len,
            tie_embeddings=True,
        )
        fields.update(overrides)
        return cls(vocab_size, num_hiddens, num_heads, num_blks, **fields)

    @classmethod
    def llama(
        cls,
        vocab_size: int = 128,
        num_hiddens: int = 64,
        num_heads: int = 4,
        num_blks: int = 2,
        *,
        num_kv_heads: int | None = 2,
        max_len: int = 128,
        **overrides: Any,
    ) -> DecoderConfig:
        """Llama: pre-norm RMSNorm (eps 1e-6), SwiGLU, RoPE (theta 1e4),
        grouped-query attention, no biases, untied head."""
        fields = dict(
            _LLAMA_FAMILY, num_kv_heads=num_kv_heads, norm_eps=1e-6,
            placement="pre", max_len=max_len,
        )  # fmt: skip
        return cls(
            vocab_size, num_hiddens, num_heads, num_blks, **{**fields, **overrides}
        )

    @classmethod
    def olmo2(
        cls,
        vocab_size: int = 128,
        num_hiddens: int = 64,
        num_heads: int = 4,
        num_blks: int = 2,
        *,
        num_kv_heads: int | None = None,
        max_len: int = 128,
        **overrides: Any,
    ) -> DecoderConfig:
        """OLMo 2: norm on each branch output (`"output"`), RMSNorm (eps 1e-5),
        full-width QK-norm, SwiGLU, RoPE (theta 1e4), no biases, untied head."""
        fields = dict(
            _LLAMA_FAMILY, num_kv_heads=num_kv_heads, norm_eps=1e-5,
            placement="output", qk_norm="full", max_len=max_len,
        )  # fmt: skip
        return cls(
            vocab_size, num_hiddens, num_heads, num_blks, **{**fields, **overrides}
        )

    @classmethod
    def gemma3(
        cls,
        vocab_size: int = 128,
        num_hiddens: int = 64,
        num_heads: int = 4,
        num_blks: int = 6,
        *,
        num_kv_heads: int | None = 2,
        head_dim: int | None = 16,
        window: int = 16,
        global_every: int = 6,
        query_pre_attn_scalar: float | None = None,
        max_len: int = 128,
        **overrides: Any,
    ) -> DecoderConfig:
        """Gemma 3 (text): sandwich norms with the Gemma RMSNorm ($1 + w$, eps
        1e-6), per-head QK-norm, GeGLU (tanh), embeddings scaled by $\\sqrt d$,
        local layers (window `window`, RoPE theta 1e4) with every
        `global_every`-th layer global (theta 1e6), attention scale
        `query_pre_attn_scalar ** -0.5` (default `head_dim`), tied head."""
        check_int(_OWNER, "global_every", global_every, min=1)
        p = head_dim if head_dim is not None else num_hiddens // num_heads
        scalar = p if query_pre_attn_scalar is None else query_pre_attn_scalar
        fields = dict(
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            act="geglu",
            norm="gemma_rms",
            norm_eps=1e-6,
            placement="sandwich",
            qk_norm="head",
            positions="rope",
            rope_theta=1e6,
            local_rope_theta=10000.0,
            window=window,
            global_layers=tuple(range(global_every - 1, num_blks, global_every)),
            attn_scale=float(scalar) ** -0.5,
            embed_scale=float(num_hiddens) ** 0.5,
            max_len=max_len,
            tie_embeddings=True,
        )
        fields.update(overrides)
        return cls(vocab_size, num_hiddens, num_heads, num_blks, **fields)


def _theta_bits(theta: float) -> np.ndarray:
    """RoPE base as the attention stores it: the int32 bit pattern of the float32."""
    return np.array(theta, np.float32).view(np.int32)


def _set_layer_data(stack: Stack, cfg: DecoderConfig) -> Stack:
    """Write the per-layer window and RoPE base into the stacked attention leaves.

    Also used on a skeleton built by `eqx.filter_eval_shape`, whose integer
    leaves are abstract until written here.
    """
    if cfg.window is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.window,
            stack,
            jnp.asarray(np.array(cfg.layer_windows(), np.int32)),
        )
    thetas = cfg.layer_thetas()
    if thetas is not None:
        stack = eqx.tree_at(
            lambda s: s.blocks.attention.rope_theta,
            stack,
            jnp.asarray(np.stack([_theta_bits(t) for t in thetas])),
        )
    return stack


#: Public name for `interop` (which loads weights into an abstract skeleton).
set_layer_data = _set_layer_data


def _final_norm(cfg: DecoderConfig) -> RMSNorm | LayerNorm:
    if cfg.norm == "layer":
        return LayerNorm(cfg.num_hiddens, cfg.norm_eps)
    if cfg.norm == "gemma_rms":
        return RMSNorm(cfg.num_hiddens, cfg.norm_eps, unit_offset=True)
    return RMSNorm(cfg.num_hiddens, cfg.norm_eps)


@eqx.filter_jit
def _build(cfg: DecoderConfig, key):
    """Every random array of a `DecoderLM`, drawn in one compiled program."""
    tok_key, pos_key, stack_key, head_key = jax.random.split(key, 4)
    d = cfg.num_hiddens

    def embedding(n, k):
        return eqx.nn.Embedding(weight=0.02 * jax.random.normal(k, (n, d), jnp.float32))

    block = cfg.block
    # a subclass's FFN (interop.mixtral.MoEDecoderConfig)
    ffn_factory = getattr(cfg, "ffn_factory", None)

    def make_block(k):
        return TransformerBlock(block, ffn_factory=ffn_factory, key=k)

    stack = _set_layer_data(
        Stack(make_block, cfg.num_blks, unroll=1, key=stack_key), cfg
    )
    pos = embedding(cfg.max_len, pos_key) if cfg.positions == "learned" else None
    head = (
        None
        if cfg.tie_embeddings
        else init.linear(d, cfg.vocab_size, bias=False, key=head_key)
    )
    return embedding(cfg.vocab_size, tok_key), pos, stack, head


class DecoderLM(eqx.Module):
    r"""A causal decoder-only language model on a scanned `Stack`.

    For token ids $t_1, \ldots, t_T$ at positions $s_1, \ldots, s_T$
    (default $0, \ldots, T-1$):
    $$h_0 = \gamma\, E[t] \;(+\, P[s]),\qquad
    h_N = \mathrm{Stack}(h_0;\ L_i = i,\ s),\qquad
    \text{logits} = \mathrm{Norm}(h_N)\, W_\text{head}^\top,$$
    with $\gamma$ the optional `embed_scale`, $P$ the learned position table
    (`positions="learned"`; with `"rope"` the positions rotate the queries and
    keys of every layer instead), the per-query valid length $L_i = i$ (causal;
    the local layers further restrict query $q$ to keys $k > q - w$), and
    $W_\text{head} = E$ when the embeddings are tied.

    The blocks are `TransformerBlock`s built from the config and run as one
    `lax.scan`; the per-layer window and RoPE base are integer leaves of the
    stacked attention (data, not structure). Weights are drawn as `CharLM`
    draws them (embeddings $\mathcal N(0, 0.02^2)$, blocks at their default
    initialization); `from_huggingface` replaces them all.

    Attributes:
        token_emb: `(vocab, d)` token embedding $E$.
        pos_emb: `(max_len, d)` learned positions, or `None` (RoPE).
        stack: the `Stack` of blocks.
        norm: the final norm.
        head: the untied output projection `(vocab, d)`, or `None` (tied).
        cfg: the `DecoderConfig` (static).
    """

    token_emb: eqx.nn.Embedding
    pos_emb: eqx.nn.Embedding | None
    stack: Stack
    norm: RMSNorm | LayerNorm
    head: eqx.nn.Linear | None
    cfg: DecoderConfig = eqx.field(static=True)

    def __init__(
        self,
        config: DecoderConfig | Mapping[str, Any],
        *,
        config_class: str = "DecoderConfig",
        key: PRNGKeyArray,
    ):
        """Args:
        config: a `DecoderConfig`, or the mapping of its fields (as
            `DecoderLM.config()["config"]` returns it).
        config_class: with a mapping, the name of the config class to build
            (`"DecoderConfig"` or a subclass such as `"MoEDecoderConfig"`).
        key: PRNG key for every weight.
        """
        if isinstance(config, Mapping):
            if config_class not in CONFIG_CLASSES:
                raise ConfigError(
                    f"DecoderLM: config_class must be one of "
                    f"{sorted(CONFIG_CLASSES)}, got {config_class!r}."
                )
            config = dict(config)
            if config.get("global_layers") is not None:
                config["global_layers"] = tuple(config["global_layers"])
            config = CONFIG_CLASSES[config_class](**config)
        if not isinstance(config, DecoderConfig):
            raise ConfigError(
                "DecoderLM: config must be a DecoderConfig, got "
                f"{type(config).__name__}."
            )
        check_key("DecoderLM", "key", key)
        self.cfg = config
        self.token_emb, self.pos_emb, self.stack, self.head = _build(config, key)
        self.norm = _final_norm(config)
        if config.parametrization != "standard":
            # the table's zero-initialised leaves (query, untied readout)
            parts = {"stack": self.stack, "head": self.head}
            parts = parametrization.apply_init(parts, config.parametrization)
            self.stack, self.head = parts["stack"], parts["head"]

    def config(self) -> dict[str, Any]:
        """The constructor arguments (without `key`) that rebuild this structure."""
        out: dict[str, Any] = {"config": self.cfg.to_dict()}
        if type(self.cfg) is not DecoderConfig:
            out["config_class"] = type(self.cfg).__name__
        return out

    @property
    def head_weight(self) -> Float[Array, "vocab d"]:
        """The output projection: the token embedding when tied."""
        return self.token_emb.weight if self.head is None else self.head.weight

    # Cached decoding (blocklab.generate) ------------------------------------

    def init_cache(
        self,
        batch_shape: tuple[int, ...] = (),
        max_len: int | None = None,
        dtype: Any = None,
    ) -> _cache.DecoderCache:
        """An empty `DecoderCache` (length 0) for `batch_shape` sequences.

        Args:
            batch_shape: `()` for one sequence, `(B,)` for a batch.
            max_len: tokens each sequence may hold, at most (default)
                `cfg.max_len`. Every layer keeps all of them, the local
                (window) layers too (one cache shape for the scanned stack;
                they mask the keys older than their window).
            dtype: of the keys and values; default the embedding's.
        """
        return _cache.init_cache(
            self, batch_shape, max_len, dtype, owner="DecoderLM.init_cache"
        )

    def prefill(
        self,
        ids: Int[ArrayLike, "*batch T"],
        cache: _cache.DecoderCache | None = None,
        *,
        lengths: Int[ArrayLike, "*batch"] | None = None,
    ) -> tuple[Float[Array, "*batch T vocab"], _cache.DecoderCache]:
        r"""Run a prompt through the model, writing its keys and values.

        Sequence $b$'s tokens take positions and cache indices
        $\ell_b, \ldots, \ell_b + T - 1$ from its length $\ell_b$ in the
        cache (0 for a fresh one), so `prefill` also extends a cache by a
        chunk. Row $i$ of the logits equals `self(...)` at position
        $\ell_b + i$ of the whole sequence.

        Args:
            ids: `(T,)` or `(*batch, T)` token ids.
            cache: from `init_cache`; `None` makes one of `cfg.max_len`.
            lengths: ragged right-padded prompts, shape `batch` (one per
                sequence, never per query): sequence $b$'s length grows
                by `lengths[b]` (in `[1, T]`) instead of $T$; its padding is
                written, but overwritten by its next tokens before any
                query sees it.

        Returns:
            `(logits, cache)`: `(*batch, T, vocab)` float32 logits and the
            cache with the new lengths.
        """
        return _cache.prefill(
            self, ids, cache, lengths, owner="DecoderLM.prefill",
            vocab=self.cfg.vocab_size,
        )  # fmt: skip

    def decode_step(
        self, ids: Int[ArrayLike, "*batch"], cache: _cache.DecoderCache
    ) -> tuple[Float[Array, "*batch vocab"], _cache.DecoderCache]:
        """One new token per sequence: `ids` of shape `cache.batch_shape`, at
        each sequence's own position `cache.length`; returns its
        `(*batch, vocab)` float32 logits (those of `self` at that position)
        and the cache one longer. Its cost depends on `cache.max_len`, not on
        the position."""
        return _cache.decode_step(
            self, ids, cache, owner="DecoderLM.decode_step", vocab=self.cfg.vocab_size
        )

    def hidden(
        self,
        ids: Int[ArrayLike, "*batch T"],
        *,
        positions: Int[ArrayLike, "*#batch T"] | None = None,
        segment_ids: Int[ArrayLike, "*#batch T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch T d"]:
        """The final-normed hidden states $\\mathrm{Norm}(h_N)$ (see `__call__`)."""
        cfg = self.cfg
        ids = jnp.asarray(ids)
        if ids.ndim < 1 or not 1 <= ids.shape[-1] <= cfg.max_len:
            raise ConfigError(
                f"DecoderLM takes sequences (T,) or batches (..., T) of 1 to "
                f"max_len={cfg.max_len} token ids, got ids.shape={tuple(ids.shape)}."
            )
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ConfigError(
                f"DecoderLM: ids must be integers, got dtype {ids.dtype}."
            )
        ids = check_ids(
            "DecoderLM", "token ids", ids, cfg.vocab_size, what="vocab_size"
        )
        T = ids.shape[-1]
        packed = {}
        if segment_ids is not None:
            seg = check_segment_ids("DecoderLM", segment_ids, ids.shape)
            packed["segment_ids"] = seg
        if positions is None:
            pos = jnp.arange(T) if segment_ids is None else segment_positions(seg)
        else:
            pos = jnp.asarray(positions)
            if not jnp.issubdtype(pos.dtype, jnp.integer) or pos.shape[-1:] != (T,):
                raise ConfigError(
                    f"DecoderLM: positions must be integers of shape (..., T={T}), "
                    f"got dtype {pos.dtype}, shape {tuple(pos.shape)}."
                )
        h = self.token_emb.weight[ids]
        if cfg.embed_scale is not None:
            h = h * jnp.asarray(cfg.embed_scale, h.dtype)
        valid_lens = causal_lengths(h.shape[:-1])
        if self.pos_emb is not None:
            pos = eqx.error_if(
                pos,
                (pos < 0) | (pos >= cfg.max_len),
                f"DecoderLM: positions must lie in [0, max_len={cfg.max_len}).",
            )
            h = h + self.pos_emb.weight[pos]
            h = self.stack(h, valid_lens, key=key, **packed)
        else:
            h = self.stack(h, valid_lens, positions=pos, key=key, **packed)
        return self.norm(h)

    def __call__(
        self,
        ids: Int[ArrayLike, "*batch T"],
        *,
        positions: Int[ArrayLike, "*#batch T"] | None = None,
        segment_ids: Int[ArrayLike, "*#batch T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch T vocab"]:
        """Next-token logits for one sequence or a batch.

        Args:
            ids: `(T,)` integer ids in `[0, vocab_size)`, `1 <= T <= max_len`,
                or a batch `(..., T)`.
            positions: integer positions `(T,)` or `(..., T)` (default
                `0..T-1`): the rows of the learned table, or the RoPE angles
                (packed sequences, generation offsets). The mask stays causal
                over the `T` inputs.
            segment_ids: packed documents, integers of shape `ids.shape` or
                `(T,)`: a token attends only to earlier tokens of its own
                segment, and (unless `positions` is given) positions restart
                at 0 at each segment change (`functional.segment_positions`),
                so each document gets the logits it would get alone.
            key: enables dropout where the blocks have any; `None` evaluates.

        Returns:
            `(..., T, vocab_size)` float32 logits; row `i` scores the token
            after `ids[..., i]`.
        """
        h = self.hidden(ids, positions=positions, segment_ids=segment_ids, key=key)
        return self.logits(h)

    def logits(self, h: Float[Array, "*batch d"]) -> Float[Array, "*batch vocab"]:
        r"""The logits of final-normed hidden states `h` (as `hidden` returns):
        $z = c_\text{out}\, h\, W_\text{head}^\top$ accumulated in float32
        ($c_\text{out}$ = `cfg.readout_multiplier`: 1, or $d_0/d$ under μP), then
        $c \tanh(z / c)$ when `cfg.final_softcap` $= c$ is set."""
        # float32 accumulation: the logits of a bf16 model are not rounded
        z = linear(h, self.head_weight, out_dtype=jnp.float32).astype(jnp.float32)
        c = self.cfg.readout_multiplier  # 1, or d0/d under muP
        z = z if c == 1.0 else z * c
        cap = self.cfg.final_softcap
        return z if cap is None else cap * jnp.tanh(z / cap)


CONFIG_CLASSES["DecoderConfig"] = DecoderConfig


def _warn_resolved(old: str, new: str) -> None:
    # A trailing underscore means "in place" in blocklab (`rms_norm_`), as in
    # PyTorch; resolved sizes live on the BlockConfig instead.
    warnings.warn(
        f"DecoderConfig.{old} is deprecated; use DecoderConfig.block.{new} "
        "(a trailing underscore means in-place in blocklab).",
        DeprecationWarning,
        stacklevel=3,
    )
