r"""`DecoderConfig`: what a decoder-only language model adds to its block.

A decoder is a `BlockConfig` repeated `num_blks` times, plus what belongs to
the model as a whole: the vocabulary, the positions (learned or rotary), the
head and its soft-cap, the embedding scale, the parametrization, and the
per-layer data of the scanned stack (which layers are local, and their RoPE
base). The block's options are declared, checked and documented once, in
`BlockConfig`; `DecoderConfig` holds that config as `block` and forwards its
fields for reading (`cfg.num_hiddens` is `cfg.block.num_hiddens`), so a new
block option reaches every decoder with no edit here.

The presets `DecoderConfig.gpt2`, `.llama`, `.olmo2` and `.gemma3` build small
models of each family without `torch`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from .._validate import ConfigError, check_bool, check_choice, check_float, check_int
from ..nn import parametrization
from ..nn.config import (
    BlockConfig,
    HoldsBlock,
    LayerSchedule,
    check_global_layers,
    ffn_width,
)
from ..nn.remat import check_remat

__all__ = ["DecoderConfig", "CONFIG_CLASSES", "DECODER_NORMS"]

#: The valid values of the block's `norm` in a decoder (also its final norm).
DECODER_NORMS = ("rms", "layer", "gemma_rms")
_OWNER = "DecoderConfig"

#: What Llama and OLMo 2 share: RMSNorm, SwiGLU, RoPE (theta 1e4), untied head.
_LLAMA_FAMILY = dict(
    act="swiglu", norm="rms", positions="rope", rope_theta=10000.0,
    tie_embeddings=False,
)  # fmt: skip

#: `DecoderConfig` and its subclasses by name, so `DecoderLM.init_args()` can
#: name the class a checkpoint must rebuild (e.g. `MoEDecoderConfig`).
CONFIG_CLASSES: dict[str, type] = {}


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class DecoderConfig(LayerSchedule, HoldsBlock):
    r"""The hyperparameters of a `DecoderLM` (frozen, hashable, validated once).

    Two spellings build the same config:

    - `DecoderConfig(vocab_size, num_blks=N, block=BlockConfig(d, H, ...))`;
    - `DecoderConfig(vocab_size, d, H, N, act=..., ...)`: every keyword that
      is not a field below is a field of `BlockConfig`, forwarded into it
      (beside `block=`, the keywords replace those fields of it:
      `dataclasses.replace(cfg, act="gelu")` works).

    The block's fields read through: `cfg.num_hiddens`, `cfg.head_dim` (always
    resolved), `cfg.rope_theta`, ... are `cfg.block`'s. In a decoder the
    block's `rope_theta` is the RoPE base of the global layers (default 1e4
    with `positions="rope"`), and its `window` $w$ the window of the local
    layers (key $k$ is visible from query $q$ when $q - w < k \le q$; `None`
    or 0: every layer is global). Under μP with no `attn_scale`, the block's
    scale is μP's ($\sqrt{p_0}/p$).

    Attributes:
        vocab_size: number of token ids $V$.
        num_blks: depth $N$ (number of blocks).
        block: the `BlockConfig` of every layer (the local/global data
            aside). Its `norm` is one of `DECODER_NORMS` and is also the
            final norm's, with its `norm_eps`.
        positions: `"learned"` (absolute position embedding added to the token
            embedding, GPT-2) or `"rope"` (rotary, half-split convention,
            applied to queries and keys in every layer).
        max_len: longest sequence; the rows of the learned position table.
            With RoPE it only bounds the inputs `DecoderLM` accepts.
        local_rope_theta: RoPE base of the local (windowed) layers; `None`:
            the block's `rope_theta`. Gemma 3: 1e4 local, 1e6 global.
        global_layers: 0-based indices of the layers with global attention
            when the block has a window (Gemma 3: every sixth, 5, 11, ...);
            `None`: every layer is local. Sorted, unique.
        embed_scale: factor on the token embedding, applied in the embedding's
            dtype (Gemma: $\sqrt d$); `None`: no scaling.
        tie_embeddings: the head reuses the token embedding ($E^\top$);
            `False` gives the model its own `head` matrix.
        final_softcap: final-logit soft-capping $c$: the logits $z$ become
            $c \tanh(z / c)$ (float32; Gemma 2: 30); `None`: no capping.
        parametrization: `"standard"` or `"mup"` (see
            `blocklab.nn.parametrization`: under μP the query projection and
            an untied head start at zero, the logits are multiplied by
            $d_0/d$ and the attention scale is $\sqrt{p_0}/p$ unless
            `attn_scale` is given; `blocklab.optimizer` applies the rates).
        base_width: the width $d_0$ at which μP equals standard (required by
            `"mup"`; every width must scale to an integer at $d_0$).
        bos_token_id, eos_token_id, pad_token_id: the checkpoint's special
            token ids (`eos_token_id` may be a tuple: several end tokens), in
            `[0, vocab_size)`; `None`: none known. Metadata: they change
            nothing the model computes. `load_pretrained` fills them from
            `config.json`, and `save_pretrained` writes them back.
        generation_config: the checkpoint's `generation_config.json`, as
            JSON text (an object), or `None`; kept and written back as is.
        remat: what the stack keeps for the backward pass
            (`blocklab.nn.remat`): `False`/`"none"`, `True`/`"full"`,
            `"dots"`, `"names:SITE,..."`, `"offload:SITE,..."`, `"nested"`
            or a `jax.checkpoint_policies` callable (not written by
            `to_dict`). Changes memory and time, never the numbers.
    """

    vocab_size: int
    num_blks: int
    block: BlockConfig
    positions: str = "rope"
    max_len: int = 2048
    local_rope_theta: float | None = None
    global_layers: tuple[int, ...] | None = None
    embed_scale: float | None = None
    tie_embeddings: bool = True
    final_softcap: float | None = None
    parametrization: str = "standard"
    base_width: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    generation_config: str | None = None
    remat: Any = False

    def __init__(
        self,
        vocab_size: int,
        num_hiddens: int | None = None,
        num_heads: int | None = None,
        num_blks: int | None = None,
        *,
        block: BlockConfig | Mapping[str, Any] | None = None,
        **options: Any,
    ):
        """Args:
        vocab_size: number of token ids.
        num_hiddens, num_heads: the block's width and heads (beside `block`,
            they replace its own).
        num_blks: depth.
        block: a `BlockConfig` (or the mapping of its fields).
        **options: the fields above, and any field of `BlockConfig`.
        """
        self._init(vocab_size, num_hiddens, num_heads, num_blks, block, options, _OWNER)
        self._check()

    def _check(self) -> None:
        """Check the model's own fields; derive the block's (RoPE base, μP)."""

        def put(name, value):
            object.__setattr__(self, name, value)

        block = self.block
        for name in ("vocab_size", "num_blks", "max_len"):
            put(name, check_int(_OWNER, name, getattr(self, name), min=1))
        check_choice(_OWNER, "block.norm", block.norm, DECODER_NORMS)
        put(
            "positions",
            check_choice(_OWNER, "positions", self.positions, ("learned", "rope")),
        )
        for name in ("embed_scale", "final_softcap"):
            value = getattr(self, name)
            put(
                name,
                check_float(_OWNER, name, value, min=0.0, min_open=True, optional=True),
            )
        put("tie_embeddings", check_bool(_OWNER, "tie_embeddings", self.tie_embeddings))
        self._check_metadata(put)
        put("remat", check_remat(_OWNER, self.remat))
        rope = self.positions == "rope"
        changes: dict[str, Any] = {}
        if not rope:
            for name, value in (
                ("rope_theta", block.rope_theta),
                ("local_rope_theta", self.local_rope_theta),
            ):
                if value is not None:
                    raise ConfigError(
                        f"{_OWNER}: {name}={value!r} needs positions='rope', got "
                        f"positions={self.positions!r}."
                    )
        elif block.rope_theta is None:
            changes["rope_theta"] = 10000.0
        put(
            "local_rope_theta",
            check_float(
                _OWNER, "local_rope_theta", self.local_rope_theta, min=0.0,
                min_open=True, optional=True,
            ),
        )  # fmt: skip
        if block.window == 0:
            changes["window"] = None  # a window of 0 is global attention
        window = changes.get("window", block.window)
        put(
            "global_layers",
            check_global_layers(_OWNER, self.global_layers, window, self.num_blks),
        )
        if self.local_rope_theta is not None and window is None:
            raise ConfigError(
                f"{_OWNER}: local_rope_theta={self.local_rope_theta!r} needs local "
                "layers; set window (and global_layers)."
            )
        sizes = {"head_dim": block.head_dim}
        if block.ffn_width != ffn_width(block.num_hiddens, block.act):
            sizes["ffn_width"] = block.ffn_width  # a chosen width must scale too
        name, base = parametrization.check_base_width(
            _OWNER, self.parametrization, self.base_width, block.num_hiddens, sizes
        )
        put("parametrization", name)
        put("base_width", base)
        if name == "mup" and block.attn_scale is None:
            changes["attn_scale"] = parametrization.attention_scale(
                name, block.head_dim, block.num_hiddens, base
            )
        if changes:
            put("block", dataclasses.replace(block, **changes))

    def _check_metadata(self, put) -> None:
        """The token ids and the generation config (metadata)."""
        vocab = self.vocab_size
        for name in ("bos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None:
                put(name, check_int(_OWNER, name, value, min=0, max=vocab - 1))
        eos = self.eos_token_id
        if isinstance(eos, (list, tuple)):
            if not eos:
                raise ConfigError(
                    f"{_OWNER}: eos_token_id must be an id, a non-empty list of "
                    "ids, or None, got []."
                )
            eos = tuple(
                check_int(_OWNER, "eos_token_id[i]", e, min=0, max=vocab - 1)
                for e in eos
            )
            put("eos_token_id", eos if len(eos) > 1 else eos[0])
        elif eos is not None:
            put(
                "eos_token_id",
                check_int(_OWNER, "eos_token_id", eos, min=0, max=vocab - 1),
            )
        text = self.generation_config
        if text is not None:
            try:
                ok = isinstance(text, str) and isinstance(json.loads(text), dict)
            except ValueError:
                ok = False
            if not ok:
                raise ConfigError(
                    f"{_OWNER}: generation_config must be the JSON text of an "
                    f"object (json.dumps of generation_config.json), got {text!r:.80}."
                )

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        CONFIG_CLASSES[cls.__name__] = cls

    @property
    def readout_multiplier(self) -> float:
        """The factor on the logits: 1, or $d_0/d$ under μP."""
        return parametrization.readout_multiplier(
            self.parametrization, self.num_hiddens, self.base_width
        )

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-friendly values (`block` as a dict, tuples as
        lists); `DecoderConfig(**d)` takes them back."""
        out = self._fields_dict()
        for name in ("global_layers", "eos_token_id"):
            if isinstance(out[name], tuple):
                out[name] = list(out[name])
        if callable(out["remat"]):
            del out["remat"]  # a function is not JSON: the default comes back
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
            act="gelu", norm="layer", norm_eps=1e-5, placement="pre", bias=True,
            positions="learned", max_len=max_len, tie_embeddings=True,
        )  # fmt: skip
        return cls(
            vocab_size, num_hiddens, num_heads, num_blks, **{**fields, **overrides}
        )

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
        return cls(
            vocab_size, num_hiddens, num_heads, num_blks, **{**fields, **overrides}
        )


CONFIG_CLASSES["DecoderConfig"] = DecoderConfig
