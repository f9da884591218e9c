"""Llama (`LlamaForCausalLM`): config mapping and weight rules.

Pre-norm RMSNorm blocks, gated MLP, RoPE (default type), grouped-query
attention, optional attention / MLP biases, tied or untied head.
"""

from __future__ import annotations

from typing import Any

from ..nn.decoder import DecoderConfig
from .hf_common import (
    HFFamily,
    Rule,
    attn_rules,
    get_field,
    llama_like,
    llama_like_fields,
    mlp_rules,
    model_global_rules,
    register_family,
)

__all__ = ["LLAMA"]


def llama_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of a `LlamaConfig`; refuses what blocklab lacks."""
    return llama_like(
        hf,
        "LlamaForCausalLM",
        DecoderConfig.llama,
        head_dim=get_field(hf, "head_dim"),
        ffn_bias=bool(get_field(hf, "mlp_bias", False)),
    )


def llama_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `LlamaConfig` fields of `cfg` (the inverse of `llama_config`)."""
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        attention_bias=cfg.attn_bias,
        mlp_bias=cfg.ffn_bias,
    )


def llama_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Llama block: `input_layernorm`, `self_attn`, `post_attention_layernorm`
    (the pre-norm of the MLP), `mlp`."""
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *attn_rules(cfg),
        Rule("post_attention_layernorm.weight", ("norm2.weight",)),
        *mlp_rules(cfg),
    ]


LLAMA = register_family(
    HFFamily(
        name="llama",
        classes=("LlamaForCausalLM",),
        to_config=llama_config,
        hf_fields=llama_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=llama_layer,
        global_rules=model_global_rules,
    )
)
