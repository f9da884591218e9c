r"""Qwen 3 (`Qwen3ForCausalLM`): config mapping and weight rules.

Llama's block with per-head QK-norm: each query and key head is
RMS-normalized over its $p$ features with one gain per norm shared by the
heads (`self_attn.q_norm.weight`, `k_norm.weight` of shape $(p,)$, eps
`rms_norm_eps`), after the split into heads and before RoPE
(blocklab's `qk_norm="head"`). `head_dim` is free (default 128, not
`hidden_size / num_attention_heads`). `attention_bias` puts biases on all
four projections. The sliding-window fields are Qwen 2's.
"""

from __future__ import annotations

from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Rule,
    attn_rules,
    mlp_rules,
    pre_norm_layer,
    qk_norm_rules,
    register_llama_layout,
)
from .qwen2 import FIELDS as QWEN2_FIELDS
from .qwen2 import qwen_config, qwen_fields

__all__ = ["QWEN3"]

_CLS = "Qwen3ForCausalLM"

#: Every `Qwen3Config` field blocklab understands, with its default: those of
#: `Qwen2Config`, with a `head_dim` of its own and `attention_bias`.
FIELDS = {**QWEN2_FIELDS, "head_dim": 128, "attention_bias": False}


def qwen3_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `Qwen3Config`; refuses what blocklab lacks."""
    return qwen_config(_CLS, hf, FIELDS, qk_norm="head")


def qwen3_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Qwen3Config` fields of `cfg` (the inverse of `qwen3_config`)."""
    return dict(qwen_fields(cfg), attention_bias=cfg.attn_bias)


def qwen3_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Qwen 3 block: Llama's, with the per-head `q_norm` / `k_norm` gains."""
    return pre_norm_layer(attn_rules(cfg) + qk_norm_rules(cfg), mlp_rules(cfg))


QWEN3 = register_llama_layout(
    "qwen3", _CLS, qwen3_config, qwen3_fields, qwen3_layer, FIELDS
)
