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

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    LAYER_TYPES,
    Derived,
    register_llama_layout,
    rope_fields,
    rope_theta,
    understood,
)
from .gemma3 import gemma3_layer, gemma_config, gemma_fields

__all__ = ["GEMMA2"]

_CLS = "Gemma2ForCausalLM"

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
        lambda f: [LAYER_TYPES[(i + 1) % 2] for i in range(f.num_hidden_layers)]
    ),
    "final_logit_softcapping": 30.0,
    "attn_logit_softcapping": 50.0,
    "use_bidirectional_attention": None,
    "tie_word_embeddings": True,
}


def gemma2_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `Gemma2Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    softcaps = {}
    for field, name in (
        ("attn_logit_softcapping", "attn_softcap"),
        ("final_logit_softcapping", "final_softcap"),
    ):
        value = getattr(hf, field)
        softcaps[name] = None if value is None else float(value)
    return gemma_config(
        _CLS,
        hf,
        rope_theta=rope_theta(_CLS, hf.rope_parameters, "rope_parameters"),
        **softcaps,
    )


def gemma2_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Gemma2Config` fields of `cfg` (the inverse of `gemma2_config`).

    A model whose `embed_scale` is not $\\sqrt d$ (or that has a second RoPE
    base, QK-norm, ...) maps to a Gemma 2 config that differs in that
    setting, which `unsupported_settings` then names."""
    windowed = any(cfg.layer_windows())
    return dict(
        gemma_fields(cfg),
        rope_parameters=rope_fields(cfg.rope_theta),
        sliding_window=cfg.window if windowed else None,
        attn_logit_softcapping=cfg.attn_softcap,
        final_logit_softcapping=cfg.final_softcap,
        use_bidirectional_attention=None,
    )


# the weights are named as Gemma 3's (less the QK-norm gains, which it lacks)
GEMMA2 = register_llama_layout(
    "gemma2", _CLS, gemma2_config, gemma2_fields, gemma3_layer, FIELDS
)
