"""Llama (`LlamaForCausalLM`): config mapping and weight rules.

Pre-norm RMSNorm blocks, gated MLP, RoPE (default type), grouped-query
attention, optional attention / MLP biases, tied or untied head.
"""

from __future__ import annotations

from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Derived,
    Rule,
    attn_rules,
    get_field,
    llama_like,
    llama_like_fields,
    mlp_rules,
    pre_norm_layer,
    register_llama_layout,
    understood,
)

__all__ = ["LLAMA"]

#: Every `LlamaConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": Derived(lambda f: f.num_attention_heads),
    "head_dim": Derived(lambda f: f.hidden_size // f.num_attention_heads),
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "pretraining_tp": 1,  # read by no transformers 5 code
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "tie_word_embeddings": False,
}


def llama_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `LlamaConfig`; refuses what blocklab lacks."""
    hf = understood("LlamaForCausalLM", hf, FIELDS)
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
    return pre_norm_layer(attn_rules(cfg), mlp_rules(cfg))


LLAMA = register_llama_layout(
    "llama", "LlamaForCausalLM", llama_config, llama_fields, llama_layer, FIELDS
)
