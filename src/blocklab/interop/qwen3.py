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

from ..nn.decoder_config import DecoderConfig
from .hf_common import (
    HFFamily,
    Rule,
    attn_rules,
    llama_like,
    llama_like_fields,
    mlp_rules,
    model_global_rules,
    qk_norm_rules,
    register_family,
    understood,
)
from .qwen2 import SLIDING_FIELDS, layer_windows, sliding_fields

__all__ = ["QWEN3"]

_CLS = "Qwen3ForCausalLM"

#: Every `Qwen3Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "head_dim": 128,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    **SLIDING_FIELDS,
}


def qwen3_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of a `Qwen3Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    return llama_like(
        hf,
        _CLS,
        DecoderConfig.llama,
        head_dim=hf.head_dim,
        qk_norm="head",
        **layer_windows(_CLS, hf),
    )


def qwen3_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Qwen3Config` fields of `cfg` (the inverse of `qwen3_config`)."""
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        attention_bias=cfg.attn_bias,
        max_window_layers=cfg.num_blks,  # unused: layer_types is explicit
        **sliding_fields(cfg),
    )


def qwen3_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Qwen 3 block: Llama's, with the per-head `q_norm` / `k_norm` gains."""
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *attn_rules(cfg),
        *qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("norm2.weight",)),
        *mlp_rules(cfg),
    ]


QWEN3 = register_family(
    HFFamily(
        name="qwen3",
        classes=(_CLS,),
        to_config=qwen3_config,
        hf_fields=qwen3_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=qwen3_layer,
        global_rules=model_global_rules,
        fields=FIELDS,
    )
)
