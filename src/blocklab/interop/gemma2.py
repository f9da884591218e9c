r"""Gemma 2 (`Gemma2ForCausalLM`): config mapping and weight rules.

The Gemma 3 block without QK-norm, plus soft-capping:

- sandwich norms (`input_layernorm` before attention, `post_attention_layernorm`
  on its output, `pre_feedforward_layernorm` / `post_feedforward_layernorm`
  around the MLP) with the Gemma RMSNorm, gain $1 + w$ (blocklab's
  `"gemma_rms"`, which stores the same $w$);
- attention scores $s = (q \cdot k)\,$`query_pre_attn_scalar`$^{-1/2}$, then
  soft-capped $c \tanh(s / c)$ with $c$ = `attn_logit_softcapping` (after the
  scale, before the mask); `None`: no cap;
- final logits $z$ soft-capped $c \tanh(z / c)$, $c$ =
  `final_logit_softcapping` (`DecoderConfig.final_softcap`);
- local and global layers alternating (`layer_types`; by default layer 0
  local, layer 1 global, ...), the local ones over a window of
  `sliding_window` keys ($q - W < k \le q$), one RoPE base for all;
- GeGLU (tanh GELU), embeddings scaled by $\sqrt d$ in the weight dtype, tied
  head.

Every one of these is on by default in `Gemma2Config` (softcaps 50 and 30,
window 4096), so a `config.json` without the keys has them.
"""

from __future__ import annotations

from typing import Any

from ..nn.decoder_config import DecoderConfig
from .gemma3 import gemma3_layer
from .hf_common import (
    Derived,
    HFFamily,
    forward_settings,
    gated_act,
    hf_gated_act,
    model_global_rules,
    refuse,
    register_family,
    rope_fields,
    rope_theta,
    understood,
)

__all__ = ["GEMMA2"]

_CLS = "Gemma2ForCausalLM"
_TYPES = ("full_attention", "sliding_attention")

#: Every `Gemma2Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 256000,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_act": None,  # in Gemma 2's config.json, read by no transformers 5 code
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "layer_types": Derived(
        lambda f: [_TYPES[(i + 1) % 2] for i in range(f.num_hidden_layers)]
    ),
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
    "tie_word_embeddings": True,
}


def gemma2_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of a `Gemma2Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    if hf.use_bidirectional_attention:
        raise refuse(
            _CLS,
            "use_bidirectional_attention",
            hf.use_bidirectional_attention,
            "blocklab's decoder is causal",
        )
    types = list(hf.layer_types)
    unknown = sorted(set(types) - set(_TYPES))
    if unknown:
        raise refuse(
            _CLS, "layer_types", unknown[0], f"layer types must be one of {_TYPES}"
        )
    if len(types) != hf.num_hidden_layers:
        raise refuse(
            _CLS, "layer_types", types, f"expected {hf.num_hidden_layers} entries"
        )
    sliding = _TYPES[1] in types
    if sliding and hf.sliding_window is None:
        raise refuse(_CLS, "sliding_window", None, "sliding layers need a window")
    full = tuple(i for i, t in enumerate(types) if t == _TYPES[0])
    theta = rope_theta(_CLS, hf.rope_parameters, "rope_parameters")
    softcaps = {}
    for field, name in (
        ("attn_logit_softcapping", "attn_softcap"),
        ("final_logit_softcapping", "final_softcap"),
    ):
        value = getattr(hf, field)
        softcaps[name] = None if value is None else float(value)
    return DecoderConfig(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        num_kv_heads=hf.num_key_value_heads or hf.num_attention_heads,
        head_dim=hf.head_dim,
        ffn_width=hf.intermediate_size,
        act=gated_act(_CLS, hf, "hidden_activation"),
        norm="gemma_rms",
        norm_eps=float(hf.rms_norm_eps),
        placement="sandwich",
        attn_bias=bool(hf.attention_bias),
        positions="rope",
        max_len=hf.max_position_embeddings,
        rope_theta=theta,
        window=hf.sliding_window if sliding else None,
        global_layers=(full or None) if sliding else None,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf.hidden_size) ** 0.5,
        tie_embeddings=bool(hf.tie_word_embeddings),
        **softcaps,
    )


def _scalar(scale: float) -> int | float:
    """`query_pre_attn_scalar` of the attention scale `scalar ** -0.5` (an int
    when it is one to 1e-9, as `Gemma2Config` types it)."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) <= 1e-9 * scalar else scalar


def gemma2_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Gemma2Config` fields of `cfg` (the inverse of `gemma2_config`).

    A model whose `embed_scale` is not $\\sqrt d$ (or that has a second RoPE
    base, QK-norm, ...) maps to a Gemma 2 config that differs in that
    setting, which `unsupported_settings` then names."""
    settings = forward_settings(cfg)
    windowed = any(cfg.layer_windows())
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.num_hiddens,
        num_attention_heads=cfg.num_heads,
        num_hidden_layers=cfg.num_blks,
        num_key_value_heads=cfg.block.num_kv_heads,
        head_dim=cfg.block.head_dim,
        intermediate_size=settings["ffn_width"],
        hidden_activation=hf_gated_act(cfg.act),
        rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.attn_bias,
        max_position_embeddings=cfg.max_len,
        rope_parameters=rope_fields(cfg.rope_theta),
        sliding_window=cfg.window if windowed else None,
        layer_types=[
            _TYPES[0] if cfg.is_global(i) else _TYPES[1] for i in range(cfg.num_blks)
        ],
        query_pre_attn_scalar=_scalar(settings["attn_scale"]),
        attn_logit_softcapping=cfg.attn_softcap,
        final_logit_softcapping=cfg.final_softcap,
        use_bidirectional_attention=None,
        tie_word_embeddings=cfg.tie_embeddings,
    )


GEMMA2 = register_family(
    HFFamily(
        name="gemma2",
        classes=(_CLS,),
        to_config=gemma2_config,
        hf_fields=gemma2_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=gemma3_layer,
        global_rules=model_global_rules,
        fields=FIELDS,
    )
)
