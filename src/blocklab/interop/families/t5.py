r"""T5 (`T5ForConditionalGeneration`, v1.0 and v1.1), mT5 and umT5: config and weights.

T5 (Raffel et al., 2020) is an encoder–decoder of pre-norm blocks with
RMSNorm without mean subtraction or bias ($\epsilon = 10^{-6}$), no biases,
no absolute positions and no $1/\sqrt{d_{kv}}$ on the attention logits
(`attn_scale=1.0`); each stack's first layer owns a relative position bias
table (`nn.relative_position`: bidirectional buckets in the encoder, causal in
the decoder) that every layer of the stack adds; cross-attention has none.
The FFN is `"gated-gelu"` (v1.1: $W_2(\mathrm{gelu_{tanh}}(x W_g^\top) \odot
x W_1^\top)$, blocklab's `"geglu"`) or `"relu"` (v1.0). The head is the
shared embedding or an untied `lm_head`; with `scale_decoder_outputs` (read
from `tie_word_embeddings` in older configs) the final-normed decoder output
is multiplied by $d^{-1/2}$ first.

`transformers` 5 forces `tie_word_embeddings=True` in the config object and
keeps `lm_head` untied when a stored `lm_head.weight` differs from the shared
embedding; so does the conversion.

mT5 (`MT5ForConditionalGeneration`) is T5 v1.1's mathematics with other
config defaults, and its `transformers` model never rescales the decoder
output (no `scale_decoder_outputs`): it converts to the same
`EncoderDecoderConfig` with `head_scale=None` (and is written back as a T5
of that layout). umT5 (`UMT5ForConditionalGeneration`) differs from T5 in one
place: every self-attention layer of both stacks owns a relative position bias
table (`encoder.block.{i}.layer.0.SelfAttention.relative_attention_bias`),
blocklab's `relative_bias="per_layer"`; the buckets, the masks, the missing
bias of the cross-attention and the head's rescaling are T5's.

`T5EncoderModel` and `UMT5EncoderModel` (the encoder half alone: its
final-normed states, `last_hidden_state`) convert to an `EncoderModel` with
`positions="relative"` (one table, or umT5's one per layer) and no head.
"""

from __future__ import annotations

from typing import Any

from ...models.encoder import EncoderModel
from ...models.encoder_config import EncoderConfig, EncoderDecoderConfig
from ...models.encoder_decoder import EncoderDecoderLM
from ..hf_common import Derived, Family, Rule, refuse, register_family, understood

__all__ = [
    "MT5", "T5", "T5_ENCODER", "UMT5", "UMT5_ENCODER", "t5_config", "t5_fields",
    "t5_rules",
]  # fmt: skip

_CLS = "T5ForConditionalGeneration"
_MT5 = "MT5ForConditionalGeneration"
_UMT5 = "UMT5ForConditionalGeneration"
_ENC = "T5EncoderModel"
_UMT5_ENC = "UMT5EncoderModel"

#: `feed_forward_proj` -> blocklab's `act` (`"gated-gelu"` is tanh GELU in
#: `transformers`, whereas a plain `"gelu"` is the exact one).
_ACTS = {
    "relu": "relu",
    "gated-gelu": "geglu",
    "gated-relu": "reglu",
    "gated-silu": "swiglu",
    "gelu": "gelu_exact",
    "gelu_new": "gelu",
}
_HF_ACTS = {v: k for k, v in _ACTS.items()}

#: Every `T5Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 32128,
    "d_model": 512,
    "d_kv": 64,
    "d_ff": 2048,
    "num_layers": 6,
    "num_decoder_layers": Derived(lambda f: f.num_layers),
    "num_heads": 8,
    "relative_attention_num_buckets": 32,
    "relative_attention_max_distance": 128,
    "dropout_rate": 0.1,  # dropout: refused in training mode
    "classifier_dropout": 0.0,
    "layer_norm_epsilon": 1e-6,
    "initializer_factor": 1.0,
    "feed_forward_proj": "relu",
    # derived from feed_forward_proj by transformers, whatever is stored
    "dense_act_fn": None,
    "is_gated_act": None,
    "is_decoder": False,
    "tie_word_embeddings": True,
    "scale_decoder_outputs": None,
    "n_positions": None,  # legacy keys of old config.json files, read by no code
    "output_past": None,
    "gradient_checkpointing": False,
}

#: The fields of `MT5Config` and `UMT5Config`: T5's, with their defaults
#: (what a `config.json` that leaves a field out means).
_MT5_DEFAULTS = dict(
    vocab_size=250112, d_ff=1024, num_layers=8, num_heads=6,
    feed_forward_proj="gated-gelu",
)  # fmt: skip
_CLASS_FIELDS = {
    _CLS: FIELDS,
    _ENC: FIELDS,
    _MT5: {**FIELDS, **_MT5_DEFAULTS},
    _UMT5: {**FIELDS, **_MT5_DEFAULTS},
    _UMT5_ENC: {**FIELDS, **_MT5_DEFAULTS},
}


def _token(hf: Any, name: str, default: int | None, vocab: int) -> int | None:
    """The token id `name` of the config (`None` where it says none, e.g. no
    end token); `default` where the config lacks it or it is not an id."""
    if name == "eos_token_id" and hasattr(hf, name) and getattr(hf, name) is None:
        return None
    v = getattr(hf, name, default)
    if isinstance(v, (list, tuple)):
        v = v[0] if v else None
    return v if isinstance(v, int) and 0 <= v < vocab else default


def t5_config(hf: Any, cls: str = _CLS) -> EncoderDecoderConfig | EncoderConfig:
    """The `EncoderDecoderConfig` of a `T5Config` (`MT5Config`, `UMT5Config`
    for `cls` their model class; the `EncoderConfig` of a `T5EncoderModel`);
    refuses (by name) what blocklab does not implement."""
    if cls not in _CLASS_FIELDS:
        raise refuse(cls, "architectures", cls, f"supported: {list(_CLASS_FIELDS)}")
    fields = _CLASS_FIELDS[cls]
    vocab = getattr(hf, "vocab_size", fields["vocab_size"])
    ids = dict(
        decoder_start_token_id=_token(hf, "decoder_start_token_id", 0, vocab),
        eos_token_id=_token(hf, "eos_token_id", 1, vocab),
        pad_token_id=_token(hf, "pad_token_id", 0, vocab),
    )
    hf = understood(cls, hf, fields)
    proj = hf.feed_forward_proj
    if proj not in _ACTS:
        raise refuse(cls, "feed_forward_proj", proj, f"implemented: {sorted(_ACTS)}")
    if hf.is_decoder:
        raise refuse(cls, "is_decoder", True, "a T5 model is an encoder–decoder")
    scale = hf.scale_decoder_outputs
    if scale is None:  # transformers reads it from tie_word_embeddings
        scale = hf.tie_word_embeddings is not False
    if cls == _MT5:  # MT5ForConditionalGeneration never rescales
        scale = False
    common = dict(
        head_dim=hf.d_kv,
        ffn_width=hf.d_ff,
        act=_ACTS[proj],
        norm="rms",
        norm_eps=float(hf.layer_norm_epsilon),
        placement="pre",
        bias=False,
        attn_scale=1.0,
        positions="relative",
        relative_num_buckets=hf.relative_attention_num_buckets,
        relative_max_distance=hf.relative_attention_max_distance,
    )
    args = (hf.vocab_size, hf.d_model, hf.num_heads, hf.num_layers)
    common["relative_bias"] = "per_layer" if cls in (_UMT5, _UMT5_ENC) else "shared"
    if cls in (_ENC, _UMT5_ENC):
        return EncoderConfig(*args, pad_token_id=ids["pad_token_id"], **common)
    return EncoderDecoderConfig(
        *args,
        num_decoder_blks=hf.num_decoder_layers,
        tie_embeddings=True,
        head_scale=float(hf.d_model) ** -0.5 if scale else None,
        **common,
        **ids,
    )


def t5_fields(cfg: EncoderDecoderConfig | EncoderConfig) -> dict[str, Any]:
    """The `T5Config` fields of `cfg` (the inverse of `t5_config`)."""
    b = cfg.block
    common = dict(
        vocab_size=cfg.vocab_size,
        d_model=cfg.num_hiddens,
        d_kv=b.head_dim,
        d_ff=b.ffn_width,
        num_layers=cfg.num_blks,
        num_heads=cfg.num_heads,
        relative_attention_num_buckets=cfg.relative_num_buckets,
        relative_attention_max_distance=cfg.relative_max_distance,
        dropout_rate=0.0,
        layer_norm_epsilon=b.norm_eps,
        feed_forward_proj=_HF_ACTS[b.act],
    )
    if isinstance(cfg, EncoderConfig):
        return dict(common, is_encoder_decoder=False, pad_token_id=cfg.pad_token_id)
    return dict(
        common,
        num_decoder_layers=cfg.num_decoder_blks,
        is_encoder_decoder=True,
        tie_word_embeddings=cfg.tie_embeddings,
        scale_decoder_outputs=cfg.head_scale is not None,
        decoder_start_token_id=cfg.decoder_start_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def _t5_block(b: Any) -> bool:
    """Whether the block config `b` is T5's: pre-norm RMSNorm, no biases,
    unscaled scores ($QK^\top$, scale 1), one key/value head per query head,
    no q/k norm or score softcap, an activation T5 names."""
    return (
        b.norm == "rms" and b.placement == "pre" and b.act in _HF_ACTS
        and not b.attn_bias and not b.ffn_bias and not b.attn_out_bias
        and b.attn_scale == 1.0 and b.num_kv_heads == b.num_heads
        and not b.qk_norm and b.attn_softcap is None
    )  # fmt: skip


def _expressible(cfg: Any, relative_bias: str = "shared") -> bool:
    """Whether `cfg` is a T5 (`"shared"`) or a umT5 (`"per_layer"`): what
    `t5_config` builds, at any sizes."""
    if not isinstance(cfg, EncoderDecoderConfig):
        return False
    scale = cfg.head_scale
    return (
        _t5_block(cfg.block) and cfg.positions == "relative"
        and cfg.relative_bias == relative_bias
        and (scale is None or abs(scale - cfg.num_hiddens**-0.5) < 1e-12)
    )  # fmt: skip


def _encoder_expressible(cfg: Any, relative_bias: str = "shared") -> bool:
    """Whether `cfg` is a `T5EncoderModel` (`"shared"`) or a
    `UMT5EncoderModel` (`"per_layer"`): T5's blocks and relative bias, a
    final norm, no embedding norm, head or pooler."""
    if not isinstance(cfg, EncoderConfig) or cfg.relative_bias != relative_bias:
        return False
    return (
        _t5_block(cfg.block) and cfg.block.window is None
        and cfg.positions == "relative" and cfg.final_norm and not cfg.embed_norm
        and cfg.first_attn_norm and not cfg.mlm_head and cfg.num_labels == 0
        and cfg.type_vocab_size == 0 and cfg.image_size is None
    )  # fmt: skip


def _ffn(cfg: Any, hf: str, ours: str) -> list[Rule]:
    if cfg.block.gated:
        pairs = (("wi_0", "W_g"), ("wi_1", "W_1"), ("wo", "W_2"))
    else:
        pairs = (("wi", "W_1"), ("wo", "W_2"))
    return [
        Rule(f"{hf}.DenseReluDense.{h}.weight", (f"{ours}.ffn.{o}.weight",))
        for h, o in pairs
    ]


def _attn(hf: str, ours: str) -> list[Rule]:
    return [Rule(f"{hf}.{n}.weight", (f"{ours}.W_{n}.weight",)) for n in "qkvo"]


def _rel(cfg: Any, stack: str, num_blks: int) -> list[Rule]:
    """The relative position bias tables of a stack: layer 0's (T5, mT5), or
    every layer's (umT5)."""
    hf = f"{stack}.block.{{}}.layer.0.SelfAttention.relative_attention_bias.weight"
    if isinstance(cfg, EncoderConfig):
        ours = "rel_bias"
    else:
        ours = "enc_rel_bias" if stack == "encoder" else "dec_rel_bias"
    if cfg.relative_bias == "shared":
        return [Rule(hf.format(0), (f"{ours}.weight",))]
    return [Rule(hf.format(i), (f"{ours}.blocks.{i}.weight",)) for i in range(num_blks)]


def t5_rules(cfg: EncoderDecoderConfig | EncoderConfig, cls: str = _CLS) -> list[Rule]:
    """Every stored tensor and its blocklab parameter."""
    rules = [Rule("shared.weight", ("token_emb.weight",))]
    encoder_only = isinstance(cfg, EncoderConfig)
    stack = "stack" if encoder_only else "encoder"
    for i in range(cfg.num_blks):
        e, o = f"encoder.block.{i}.layer", f"{stack}.blocks.{i}"
        rules += _attn(f"{e}.0.SelfAttention", f"{o}.attention")
        rules.append(Rule(f"{e}.0.layer_norm.weight", (f"{o}.norm1.weight",)))
        rules += _ffn(cfg, f"{e}.1", o)
        rules.append(Rule(f"{e}.1.layer_norm.weight", (f"{o}.norm2.weight",)))
    rules += _rel(cfg, "encoder", cfg.num_blks)
    if encoder_only:
        return [*rules, Rule("encoder.final_layer_norm.weight", ("norm.weight",))]
    rules.append(Rule("encoder.final_layer_norm.weight", ("enc_norm.weight",)))
    for i in range(cfg.num_decoder_blks):
        e, o = f"decoder.block.{i}.layer", f"decoder.blocks.{i}"
        rules += _attn(f"{e}.0.SelfAttention", f"{o}.attention")
        rules.append(Rule(f"{e}.0.layer_norm.weight", (f"{o}.norm1.weight",)))
        rules += _attn(f"{e}.1.EncDecAttention", f"{o}.cross_attn")
        rules.append(Rule(f"{e}.1.layer_norm.weight", (f"{o}.norm_cross.weight",)))
        rules += _ffn(cfg, f"{e}.2", o)
        rules.append(Rule(f"{e}.2.layer_norm.weight", (f"{o}.norm2.weight",)))
    rules += _rel(cfg, "decoder", cfg.num_decoder_blks)
    rules.append(Rule("decoder.final_layer_norm.weight", ("dec_norm.weight",)))
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("head.weight",)))
    return rules


def _tied(cfg: Any, cls: str) -> dict[str, str]:
    if cls in (_ENC, _UMT5_ENC):
        return {"encoder.embed_tokens.weight": "shared.weight"}
    out = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
    }
    if cfg.tie_embeddings:
        out["lm_head.weight"] = "shared.weight"
    return out


def _untie(cfg: EncoderDecoderConfig) -> EncoderDecoderConfig:
    import dataclasses

    return dataclasses.replace(cfg, tie_embeddings=False)


def _register(
    name: str, cls: str, model_type: str, model: type, owns: Any, **extra: Any
) -> Family:
    """Register one family of T5's layout: `transformers` class `cls`
    (`model_type`), built as `model` (`EncoderDecoderLM` or `EncoderModel`),
    exporting the models `owns` accepts; `extra`: further `Family`
    fields."""
    return register_family(
        Family(
            name=name,
            classes=(cls,),
            model_types=(model_type,),
            to_config=t5_config,
            hf_fields=t5_fields,
            rules=t5_rules,
            build=lambda cfg, key: model(cfg, key=key),
            model_class=lambda cfg: cls,
            owns=owns,
            dropout_fields=("dropout_rate", "classifier_dropout"),
            tied=_tied,
            **extra,
        )
    )


def _family(name: str, cls: str, owns: Any) -> Family:
    return _register(
        name,
        cls,
        name,
        EncoderDecoderLM,
        owns,
        ignored=(
            "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",
        ),
        untie=_untie,
        generation=True,
    )


def _owns(relative_bias: str) -> Any:
    return lambda m: (
        isinstance(m, EncoderDecoderLM) and _expressible(m.cfg, relative_bias)
    )


T5 = _family("t5", _CLS, _owns("shared"))
UMT5 = _family("umt5", _UMT5, _owns("per_layer"))


def _encoder_family(name: str, cls: str, model_type: str, relative_bias: str):
    def owns(m):
        return isinstance(m, EncoderModel) and _encoder_expressible(
            m.cfg, relative_bias
        )

    return _register(name, cls, model_type, EncoderModel, owns)


T5_ENCODER = _encoder_family("t5_encoder", _ENC, "t5", "shared")
UMT5_ENCODER = _encoder_family("umt5_encoder", _UMT5_ENC, "umt5", "per_layer")
#: mT5 converts from `transformers` only; blocklab writes its models as T5
#: (the same mathematics), so this family exports nothing.
MT5 = _family("mt5", _MT5, lambda m: False)
