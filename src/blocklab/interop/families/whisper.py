r"""Whisper (`WhisperForConditionalGeneration`): config and weights.

Whisper (Radford et al., 2022) is an encoder–decoder over a log-mel
spectrogram $x \in \mathbb R^{M \times 2S}$:
$$c = \mathrm{LN}_e\big(\mathrm{Enc}(\mathrm{gelu}(\mathrm{conv}_2(
\mathrm{gelu}(\mathrm{conv}_1 x)))^\top + P)\big),\qquad
\text{logits} = \mathrm{LN}_d\big(\mathrm{Dec}(E[t] + Q[\text{pos}];\ c)\big)\,
E^\top,$$
with `nn.audio_embed.AudioEmbedding`'s convolutions (kernel 3; the second
of stride 2) and stored sinusoids $P$, a learned decoder position table $Q$
(`max_target_positions` rows, read from the cache length on when decoding),
pre-LayerNorm blocks ($\epsilon = 10^{-5}$) with exact-GELU FFNs (`fc1`,
`fc2`), biases on the attention's query, value and output projections but
none on the key (blocklab's key bias is held at zero: a key bias adds the same
$q \cdot b$ to every score of a query, which the softmax cancels), logits
scaled by $1/\sqrt{p}$ (`transformers` scales the query first), and the head
tied to the decoder's token embedding $E$ (`proj_out`, or its own with
`tie_word_embeddings=false`).

In blocklab this is an `EncoderDecoderLM` with `src_input="audio"` and
`positions="learned"`. Refused by name: encoder and decoder of different
head counts or FFN widths (one block serves both stacks), `scale_embedding`
true (which `transformers` 5.24 reads but never applies: the file's meaning
is ambiguous), an activation other than `gelu`, `gelu_new` or `relu`, and
the other classes (`WhisperForCausalLM`, `WhisperForAudioClassification`).
"""

from __future__ import annotations

from typing import Any

from ...models.encoder_config import EncoderDecoderConfig
from ...models.encoder_decoder import EncoderDecoderLM
from ..hf_common import Family, Rule, refuse, register_family, understood

__all__ = ["WHISPER", "whisper_config", "whisper_fields", "whisper_rules"]

_CLS = "WhisperForConditionalGeneration"

#: `activation_function` -> blocklab's `act` (`"gelu"` is the exact erf GELU).
_ACTS = {"gelu": "gelu_exact", "gelu_new": "gelu", "relu": "relu"}
_HF_ACTS = {v: k for k, v in _ACTS.items()}

#: Whisper's LayerNorm epsilon (PyTorch's default; not a config field).
_EPS = 1e-5

#: Every `WhisperConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 51865,
    "num_mel_bins": 80,
    "encoder_layers": 4,
    "encoder_attention_heads": 6,
    "decoder_layers": 4,
    "decoder_attention_heads": 6,
    "decoder_ffn_dim": 1536,
    "encoder_ffn_dim": 1536,
    "activation_function": "gelu",
    "d_model": 384,
    "scale_embedding": False,
    "max_source_positions": 1500,
    "max_target_positions": 448,
    "tie_word_embeddings": True,
    # training only: refused while the PyTorch model is in training mode
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "encoder_layerdrop": 0.0,
    "decoder_layerdrop": 0.0,
    "apply_spec_augment": False,
    "mask_time_prob": 0.05,
    "mask_time_length": 10,
    "mask_time_min_masks": 2,
    "mask_feature_prob": 0.0,
    "mask_feature_length": 10,
    "mask_feature_min_masks": 0,
    "init_std": 0.02,
    # generation's rules and the other classes' heads: not the logits
    "suppress_tokens": None,
    "begin_suppress_tokens": (220, 50256),
    "median_filter_width": 7,
    "use_weighted_layer_sum": False,
    "classifier_proj_size": 256,
    # keys of the original checkpoints' config.json files
    "forced_decoder_ids": None,
    "max_length": None,
    "num_hidden_layers": None,  # an alias of encoder_layers
    "gradient_checkpointing": False,
}

#: What `transformers` uses as the training-time randomness of the forward.
_TRAINING_FIELDS = (
    "dropout", "attention_dropout", "activation_dropout", "encoder_layerdrop",
    "decoder_layerdrop", "mask_time_prob", "mask_feature_prob",
)  # fmt: skip


def _token_ids(hf: Any, vocab: int) -> dict[str, Any]:
    """Generation's ids: each the config's where it is an id of the
    vocabulary (a list: its first), else `decoder_start_token_id` 0, no
    `eos_token_id` (an id outside the vocabulary is never produced) and
    `pad_token_id` 0."""

    def read(name):
        v = getattr(hf, name, None)
        if isinstance(v, (list, tuple)):
            v = v[0] if v else None
        return v if isinstance(v, int) and 0 <= v < vocab else None

    start, eos, pad = (read(n) for n in ("decoder_start_token_id", "eos_token_id",
                                         "pad_token_id"))  # fmt: skip
    return dict(
        decoder_start_token_id=0 if start is None else start,
        eos_token_id=eos,
        pad_token_id=0 if pad is None else pad,
    )


def whisper_config(hf: Any, cls: str = _CLS) -> EncoderDecoderConfig:
    """The `EncoderDecoderConfig` of a `WhisperConfig`; refuses (by name)
    what blocklab does not implement."""
    if cls != _CLS:
        raise refuse(cls, "architectures", cls, f"supported: {[_CLS]}")
    ids = _token_ids(hf, getattr(hf, "vocab_size", FIELDS["vocab_size"]))
    hf = understood(cls, hf, FIELDS)
    if hf.activation_function not in _ACTS:
        raise refuse(
            cls, "activation_function", hf.activation_function,
            f"implemented: {sorted(_ACTS)}",
        )  # fmt: skip
    if hf.scale_embedding:
        raise refuse(
            cls, "scale_embedding", True,
            "a sqrt(d_model) factor on the decoder's token embedding, which "
            "transformers 5.24 reads but does not apply; blocklab implements "
            "neither meaning",
        )  # fmt: skip
    for enc, dec in (
        ("encoder_attention_heads", "decoder_attention_heads"),
        ("encoder_ffn_dim", "decoder_ffn_dim"),
    ):
        if getattr(hf, enc) != getattr(hf, dec):
            raise refuse(
                cls, dec, getattr(hf, dec),
                f"blocklab's encoder and decoder share one block: {dec} must "
                f"equal {enc}={getattr(hf, enc)}",
            )  # fmt: skip
    if hf.num_hidden_layers not in (None, hf.encoder_layers):
        raise refuse(
            cls, "num_hidden_layers", hf.num_hidden_layers,
            f"an alias of encoder_layers={hf.encoder_layers}, which it contradicts",
        )  # fmt: skip
    return EncoderDecoderConfig(
        hf.vocab_size,
        hf.d_model,
        hf.encoder_attention_heads,
        hf.encoder_layers,
        num_decoder_blks=hf.decoder_layers,
        ffn_width=hf.encoder_ffn_dim,
        act=_ACTS[hf.activation_function],
        norm="layer",
        norm_eps=_EPS,
        placement="pre",
        bias=True,
        positions="learned",
        max_len=hf.max_target_positions,
        tie_embeddings=bool(hf.tie_word_embeddings),
        src_input="audio",
        num_mel_bins=hf.num_mel_bins,
        max_source_len=hf.max_source_positions,
        **ids,
    )


def whisper_fields(cfg: EncoderDecoderConfig) -> dict[str, Any]:
    """The `WhisperConfig` fields of `cfg` (the inverse of `whisper_config`)."""
    b = cfg.block
    return dict(
        vocab_size=cfg.vocab_size,
        num_mel_bins=cfg.num_mel_bins,
        d_model=cfg.num_hiddens,
        encoder_layers=cfg.num_blks,
        decoder_layers=cfg.num_decoder_blks,
        encoder_attention_heads=cfg.num_heads,
        decoder_attention_heads=cfg.num_heads,
        encoder_ffn_dim=b.ffn_width,
        decoder_ffn_dim=b.ffn_width,
        activation_function=_HF_ACTS[b.act],
        max_source_positions=cfg.max_source_len,
        max_target_positions=cfg.max_len,
        scale_embedding=False,
        dropout=0.0,
        attention_dropout=0.0,
        activation_dropout=0.0,
        is_encoder_decoder=True,
        tie_word_embeddings=cfg.tie_embeddings,
        decoder_start_token_id=cfg.decoder_start_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def _expressible(cfg: Any) -> bool:
    """Whether `cfg` is a Whisper: what `whisper_config` builds, at any sizes."""
    if not isinstance(cfg, EncoderDecoderConfig):
        return False
    b = cfg.block
    return (
        cfg.src_input == "audio" and cfg.positions == "learned"
        and cfg.head_scale is None and b.norm == "layer" and b.norm_eps == _EPS
        and b.placement == "pre" and b.act in _HF_ACTS
        and b.attn_bias and b.ffn_bias and b.attn_out_bias
        and b.num_kv_heads == b.num_heads
        and b.head_dim * b.num_heads == b.num_hiddens
        and b.attn_scale in (None, b.head_dim**-0.5)
        and not b.qk_norm and b.attn_softcap is None
    )  # fmt: skip


def _attn(hf: str, ours: str) -> list[Rule]:
    """q, v, out: weight and bias; k: weight only (its bias is a constant 0)."""
    rules = []
    projections = (("q_proj", "W_q", True), ("k_proj", "W_k", False),
                   ("v_proj", "W_v", True), ("out_proj", "W_o", True))  # fmt: skip
    for h, o, biased in projections:
        for n in ("weight", "bias") if biased else ("weight",):
            rules.append(Rule(f"{hf}.{h}.{n}", (f"{ours}.{o}.{n}",)))
    return rules


def _affine(hf: str, ours: str) -> list[Rule]:
    return [Rule(f"{hf}.{n}", (f"{ours}.{n}",)) for n in ("weight", "bias")]


def _layer(hf: str, ours: str, cross: bool) -> list[Rule]:
    rules = _attn(f"{hf}.self_attn", f"{ours}.attention")
    rules += _affine(f"{hf}.self_attn_layer_norm", f"{ours}.norm1")
    if cross:
        rules += _attn(f"{hf}.encoder_attn", f"{ours}.cross_attn")
        rules += _affine(f"{hf}.encoder_attn_layer_norm", f"{ours}.norm_cross")
    rules += _affine(f"{hf}.fc1", f"{ours}.ffn.W_1")
    rules += _affine(f"{hf}.fc2", f"{ours}.ffn.W_2")
    rules += _affine(f"{hf}.final_layer_norm", f"{ours}.norm2")
    return rules


def whisper_rules(cfg: EncoderDecoderConfig, cls: str = _CLS) -> list[Rule]:
    """Every stored tensor and its blocklab parameter (on-disk names, which
    `transformers` 5.24 keeps in memory too)."""
    e, d = "model.encoder", "model.decoder"
    rules = [
        Rule(f"{e}.conv1.weight", ("audio_emb.conv1_weight",)),
        Rule(f"{e}.conv1.bias", ("audio_emb.conv1_bias",)),
        Rule(f"{e}.conv2.weight", ("audio_emb.conv2_weight",)),
        Rule(f"{e}.conv2.bias", ("audio_emb.conv2_bias",)),
        Rule(f"{e}.embed_positions.weight", ("audio_emb.pos_emb",)),
    ]
    for i in range(cfg.num_blks):
        rules += _layer(f"{e}.layers.{i}", f"encoder.blocks.{i}", cross=False)
    rules += _affine(f"{e}.layer_norm", "enc_norm")
    rules += [
        Rule(f"{d}.embed_tokens.weight", ("token_emb.weight",)),
        Rule(f"{d}.embed_positions.weight", ("dec_pos_emb.weight",)),
    ]
    for i in range(cfg.num_decoder_blks):
        rules += _layer(f"{d}.layers.{i}", f"decoder.blocks.{i}", cross=True)
    rules += _affine(f"{d}.layer_norm", "dec_norm")
    if not cfg.tie_embeddings:
        rules.append(Rule("proj_out.weight", ("head.weight",)))
    return rules


def _tied(cfg: EncoderDecoderConfig, cls: str) -> dict[str, str]:
    if cfg.tie_embeddings:
        return {"proj_out.weight": "model.decoder.embed_tokens.weight"}
    return {}


def _constants(cfg: EncoderDecoderConfig, cls: str) -> dict[str, float]:
    """The key projections' biases, which Whisper does not have (0)."""
    out = {f"encoder.blocks.{i}.attention.W_k.bias": 0.0 for i in range(cfg.num_blks)}
    for i in range(cfg.num_decoder_blks):
        for a in ("attention", "cross_attn"):
            out[f"decoder.blocks.{i}.{a}.W_k.bias"] = 0.0
    return out


WHISPER = register_family(
    Family(
        name="whisper",
        classes=(_CLS,),
        model_types=("whisper",),
        to_config=whisper_config,
        hf_fields=whisper_fields,
        rules=whisper_rules,
        build=lambda cfg, key: EncoderDecoderLM(cfg, key=key),
        model_class=lambda cfg: _CLS,
        owns=lambda m: isinstance(m, EncoderDecoderLM) and _expressible(m.cfg),
        dropout_fields=_TRAINING_FIELDS,
        tied=_tied,
        constants=_constants,
    )
)
