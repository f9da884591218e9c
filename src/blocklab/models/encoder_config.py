r"""`EncoderConfig` and `EncoderDecoderConfig`: what an encoder (BERT, ModernBERT,
ViT) or an encoder–decoder (T5, Whisper) adds to its block.

As `DecoderConfig`, each holds one `BlockConfig` as `block` (declared, checked
and documented there once) and forwards its fields for reading
(`cfg.num_hiddens` is `cfg.block.num_hiddens`); every keyword that is not a
field of the model config is a field of `BlockConfig`. An encoder's blocks
attend bidirectionally (no causal lengths); the local layers of a window use
the block's `window_mode` (`"bidirectional"`: $|q - k| < w$). An
encoder–decoder's decoder blocks are the same block with
`cross_attention=True`, so encoder and decoder are two stacks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from .._validate import ConfigError, check_bool, check_choice, check_float, check_int
from ..nn.config import (
    ACTS,
    BlockConfig,
    HoldsBlock,
    LayerSchedule,
    check_global_layers,
)

__all__ = ["EncoderConfig", "EncoderDecoderConfig"]


def config_of(owner: str, cfg: Any, cls: type) -> Any:
    """`cfg` as a `cls` (`EncoderConfig` or `EncoderDecoderConfig`): the one
    given, or built from the mapping of its fields."""
    if isinstance(cfg, Mapping):
        cfg = cls(**cfg)
    if not isinstance(cfg, cls):
        raise ConfigError(
            f"{owner}: cfg must be an {cls.__name__}, got {type(cfg).__name__}."
        )
    return cfg


class _ModelConfig(HoldsBlock):
    """What both configs share: construction, block read-through, dicts."""

    def _put(self, name, value):
        object.__setattr__(self, name, value)

    def to_dict(self) -> dict[str, Any]:
        """The fields as JSON-friendly values (`block` as a dict, tuples as
        lists); `cls(**d)` takes them back."""
        out = self._fields_dict()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}

    def _check_relative(self, owner):
        self._put(
            "relative_bias",
            check_choice(
                owner, "relative_bias", self.relative_bias, ("shared", "per_layer")
            ),
        )
        if self.relative_bias == "per_layer" and self.positions != "relative":
            raise ConfigError(
                f"{owner}: relative_bias='per_layer' needs positions='relative', "
                f"got positions={self.positions!r}."
            )
        self._put(
            "relative_num_buckets",
            check_int(owner, "relative_num_buckets", self.relative_num_buckets, min=2),
        )
        self._put(
            "relative_max_distance",
            check_int(
                owner, "relative_max_distance", self.relative_max_distance, min=1
            ),
        )


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class EncoderConfig(LayerSchedule, _ModelConfig):
    r"""The hyperparameters of an `EncoderModel` (frozen, hashable, validated once).

    `EncoderConfig(vocab_size, d, H, N, **options)` or
    `EncoderConfig(vocab_size, num_blks=N, block=BlockConfig(...))`.

    Attributes:
        vocab_size: token ids (0: no token embedding, image input).
        num_blks: depth $N$.
        block: the `BlockConfig` of every layer.
        max_len: rows of the learned position table.
        positions: `"learned"` (BERT: a table added to the token
            embedding), `"rope"` (ModernBERT: the block's `rope_theta` for the
            global layers, default 1e4, `local_rope_theta` for the local
            ones), `"relative"` (T5's bucketed bias, both directions) or
            `"none"` (ViT: its embedding carries the positions).
        relative_bias: `"shared"` (T5: one table for every layer) or
            `"per_layer"` (umT5: a table per layer, stacked `(N, buckets, H)`
            and scanned with the stack).
        relative_num_buckets, relative_max_distance: T5's buckets.
        global_layers: with a `window`, the layers that attend globally
            (others are local); `None`: every layer is local.
        local_rope_theta: RoPE base of the local layers (default the global one).
        type_vocab_size: BERT's token types (0: none).
        embed_norm: a norm (`block.norm`, `block.norm_eps`) on the summed
            embeddings (BERT, ModernBERT).
        first_attn_norm: `False`: layer 0's self-attention reads the stream
            unnormed (ModernBERT; the block's `skip_attn_norm` leaf).
        final_norm: a norm after the last block (pre-norm models; BERT's
            post-norm has none).
        image_size, patch_size, num_channels: ViT input (`ViTEmbedding`:
            patches, a CLS token and learned positions) instead of tokens.
        mlm_head: the masked-LM head $\mathrm{Norm}(\phi(h W_t^\top + b_t))
            E^\top + b$ (BERT, ModernBERT).
        head_act: $\phi$ of the MLM transform and of the `"transform"` pooler.
        head_bias: biases of those dense layers.
        decoder_bias: the MLM head's vocabulary bias $b$.
        tie_embeddings: the MLM decoder is the token embedding $E$.
        num_labels: classes of the sequence-classification head (0: none).
            Without `mlm_head` and classifier the model is a feature
            extractor (`BertModel`, `ModernBertModel`, `ViTModel`): it returns
            the final states and, with a `pooler`, `pooler_output`.
        pooling: `"cls"` (the first token) or `"mean"` (over unmasked tokens).
        pooler: `"none"` (ViT's classifier), `"tanh"` (BERT, `ViTModel`:
            $\tanh(W p + b)$) or `"transform"` (ModernBERT:
            $\mathrm{Norm}(\phi(W p))$), read by the classifier and by
            `EncoderModel.pooler_output`.
        pad_token_id: metadata.
    """

    vocab_size: int
    num_blks: int
    block: BlockConfig
    max_len: int = 512
    positions: str = "learned"
    relative_bias: str = "shared"
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    global_layers: tuple[int, ...] | None = None
    local_rope_theta: float | None = None
    type_vocab_size: int = 0
    embed_norm: bool = False
    first_attn_norm: bool = True
    final_norm: bool = True
    image_size: int | None = None
    patch_size: int | None = None
    num_channels: int = 3
    mlm_head: bool = False
    head_act: str = "gelu_exact"
    head_bias: bool = True
    decoder_bias: bool = True
    tie_embeddings: bool = True
    num_labels: int = 0
    pooling: str = "cls"
    pooler: str = "none"
    pad_token_id: int | None = None

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
        if options.get("first_attn_norm") is False:
            options.setdefault("skip_attn_norm", True)
        self._init(vocab_size, num_hiddens, num_heads, num_blks, block, options)
        self._check()

    def _check(self) -> None:
        owner, put, block = "EncoderConfig", self._put, self.block
        put("vocab_size", check_int(owner, "vocab_size", self.vocab_size, min=0))
        for name in ("num_blks", "max_len"):
            put(name, check_int(owner, name, getattr(self, name), min=1))
        put(
            "positions",
            check_choice(
                owner, "positions", self.positions,
                ("learned", "rope", "relative", "none"),
            ),
        )  # fmt: skip
        self._check_relative(owner)
        for name in ("embed_norm", "first_attn_norm", "final_norm", "mlm_head"):
            put(name, check_bool(owner, name, getattr(self, name)))
        for name in ("head_bias", "decoder_bias", "tie_embeddings"):
            put(name, check_bool(owner, name, getattr(self, name)))
        put(
            "type_vocab_size",
            check_int(owner, "type_vocab_size", self.type_vocab_size, min=0),
        )
        put("num_labels", check_int(owner, "num_labels", self.num_labels, min=0))
        put("pooling", check_choice(owner, "pooling", self.pooling, ("cls", "mean")))
        put(
            "pooler",
            check_choice(owner, "pooler", self.pooler, ("none", "tanh", "transform")),
        )
        put("head_act", check_choice(owner, "head_act", self.head_act, ACTS[:3]))
        if not self.first_attn_norm and not block.skip_attn_norm:
            raise ConfigError(
                f"{owner}: first_attn_norm=False needs the block's "
                "skip_attn_norm=True (set it, or leave block to the keywords)."
            )
        images = self.image_size is not None or self.patch_size is not None
        if images:
            put("image_size", check_int(owner, "image_size", self.image_size, min=1))
            put("patch_size", check_int(owner, "patch_size", self.patch_size, min=1))
            put(
                "num_channels",
                check_int(owner, "num_channels", self.num_channels, min=1),
            )
            if self.vocab_size or self.positions != "none" or self.type_vocab_size:
                raise ConfigError(
                    f"{owner}: image input (image_size, patch_size) takes "
                    "vocab_size=0, type_vocab_size=0 and positions='none' (the "
                    f"patch embedding carries the positions), got vocab_size="
                    f"{self.vocab_size}, positions={self.positions!r}."
                )
            if self.mlm_head:
                raise ConfigError(f"{owner}: mlm_head needs tokens, not images.")
        elif self.vocab_size < 1:
            raise ConfigError(
                f"{owner}: vocab_size must be >= 1 for token input (0 only with "
                "image_size and patch_size)."
            )
        changes: dict[str, Any] = {}
        rope = self.positions == "rope"
        if rope and block.rope_theta is None:
            changes["rope_theta"] = 10000.0
        if not rope and (block.rope_theta is not None or self.local_rope_theta):
            raise ConfigError(
                f"{owner}: rope_theta / local_rope_theta need positions='rope', got "
                f"positions={self.positions!r}."
            )
        put(
            "local_rope_theta",
            check_float(
                owner, "local_rope_theta", self.local_rope_theta, min=0.0,
                min_open=True, optional=True,
            ),
        )  # fmt: skip
        if block.window == 0:
            changes["window"] = None
        window = changes.get("window", block.window)
        put(
            "global_layers",
            check_global_layers(owner, self.global_layers, window, self.num_blks),
        )
        if block.cross_attention:
            raise ConfigError(
                f"{owner}: an encoder's blocks have no cross-attention, got "
                "cross_attention=True (use EncoderDecoderConfig)."
            )
        if changes:
            put("block", dataclasses.replace(block, **changes))


#: `EncoderDecoderConfig.positions`: T5's relative buckets, none, or
#: Whisper's learned decoder positions.
_ED_POSITIONS = ("relative", "none", "learned")


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class EncoderDecoderConfig(_ModelConfig):
    r"""The hyperparameters of an `EncoderDecoderLM` (T5, Whisper; frozen, validated).

    `EncoderDecoderConfig(vocab_size, d, H, N, num_decoder_blks=M, **options)`:
    the block options (T5 v1.1: `norm="rms"`, `act="geglu"`, `attn_scale=1.0`,
    `head_dim=d_kv`, `ffn_width=d_ff`, no biases) are those of both stacks;
    the decoder's blocks add `cross_attention=True`.

    Attributes:
        vocab_size: token ids (one embedding shared by both stacks).
        num_blks: encoder depth; num_decoder_blks: decoder depth (default
            `num_blks`).
        block: the encoder's `BlockConfig` (the decoder's is `decoder_block`).
        positions: `"relative"` (T5: bucketed bias tables, bidirectional in
            the encoder, causal in the decoder) or `"none"`.
        relative_bias: `"shared"` (T5, mT5: one table per stack, added by
            every layer) or `"per_layer"` (umT5: every self-attention layer
            has its own; the tables are stacked `(N, buckets, H)` and scanned
            with the stack).
        relative_num_buckets, relative_max_distance: T5's buckets.
        max_len: the longest target a decoding cache holds.
        tie_embeddings: the head is the token embedding.
        head_scale: a factor on the final-normed decoder output before the
            head (T5 with `scale_decoder_outputs`: $d^{-1/2}$); `None`: 1.
        decoder_start_token_id, eos_token_id, pad_token_id: generation's
            first decoder input, stop token, and the fill after it.
        src_input: `"tokens"` (T5: source ids through the shared embedding)
            or `"audio"` (Whisper: log-mel features `(..., num_mel_bins,
            2 max_source_len)` through `AudioEmbedding`'s two convolutions
            and its fixed sinusoidal positions; fixed length, no padding).
        num_mel_bins, max_source_len: the audio input's mel channels $M$ and
            the encoder's length $S$ (the input has $2S$ frames); `None`
            with tokens.

    `positions="learned"` (Whisper) gives the decoder a learned table of
    `max_len` positions added to its token embedding (offset by the cache
    length when decoding); the encoder's positions are then its audio
    input's.
    """

    vocab_size: int
    num_blks: int
    block: BlockConfig
    num_decoder_blks: int | None = None
    positions: str = "relative"
    relative_bias: str = "shared"
    relative_num_buckets: int = 32
    relative_max_distance: int = 128
    max_len: int = 512
    tie_embeddings: bool = True
    head_scale: float | None = None
    decoder_start_token_id: int = 0
    eos_token_id: int | None = None
    pad_token_id: int = 0
    src_input: str = "tokens"
    num_mel_bins: int | None = None
    max_source_len: int | None = None

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
        self._init(vocab_size, num_hiddens, num_heads, num_blks, block, options)
        owner, put = "EncoderDecoderConfig", self._put
        for name in ("vocab_size", "num_blks", "max_len"):
            put(name, check_int(owner, name, getattr(self, name), min=1))
        dec = self.num_blks if self.num_decoder_blks is None else self.num_decoder_blks
        put("num_decoder_blks", check_int(owner, "num_decoder_blks", dec, min=1))
        put(
            "positions",
            check_choice(owner, "positions", self.positions, _ED_POSITIONS),
        )
        self._check_relative(owner)
        put("tie_embeddings", check_bool(owner, "tie_embeddings", self.tie_embeddings))
        put(
            "head_scale",
            check_float(
                owner, "head_scale", self.head_scale, min=0.0, min_open=True,
                optional=True,
            ),
        )  # fmt: skip
        V = self.vocab_size
        for name in ("decoder_start_token_id", "pad_token_id"):
            put(name, check_int(owner, name, getattr(self, name), min=0, max=V - 1))
        if self.eos_token_id is not None:
            put(
                "eos_token_id",
                check_int(owner, "eos_token_id", self.eos_token_id, min=0, max=V - 1),
            )
        self._check_source(owner)
        block = self.block
        for name, bad in (
            ("rope_theta", block.rope_theta is not None),
            ("window", bool(block.window)),
            ("cross_attention", block.cross_attention),
            ("skip_attn_norm", block.skip_attn_norm),
        ):
            if bad:
                raise ConfigError(
                    f"{owner}: {name}={getattr(block, name)!r} is not implemented "
                    "in an encoder–decoder (T5 has relative positions and global "
                    "layers; the decoder's cross-attention is added by the model)."
                )

    @property
    def decoder_block(self) -> BlockConfig:
        """The decoder's `BlockConfig`: the block with `cross_attention=True`."""
        return dataclasses.replace(self.block, cross_attention=True)

    def _check_source(self, owner: str) -> None:
        """The source's fields: audio takes `num_mel_bins`, `max_source_len`
        and an even width >= 4 (its sinusoids), tokens neither; learned
        positions are the decoder's, beside an audio encoder's own."""
        put = self._put
        kinds = ("tokens", "audio")
        put("src_input", check_choice(owner, "src_input", self.src_input, kinds))
        if self.src_input == "audio":
            for name in ("num_mel_bins", "max_source_len"):
                put(name, check_int(owner, name, getattr(self, name), min=1))
            d = self.block.num_hiddens
            if d % 2 or d < 4:
                raise ConfigError(
                    f"{owner}: src_input='audio' needs an even num_hiddens >= 4 "
                    "(its sinusoidal positions are half sines, half cosines), got "
                    f"num_hiddens={d}."
                )
        else:
            for name in ("num_mel_bins", "max_source_len"):
                if getattr(self, name) is not None:
                    raise ConfigError(
                        f"{owner}: {name}={getattr(self, name)!r} is a field of "
                        "the audio input (src_input='audio'); a token source "
                        "takes none."
                    )
        if self.positions == "learned" and self.src_input != "audio":
            raise ConfigError(
                f"{owner}: positions='learned' (the decoder's table) needs "
                "src_input='audio', whose input carries the encoder's positions; "
                "a token encoder with learned positions is not implemented."
            )
