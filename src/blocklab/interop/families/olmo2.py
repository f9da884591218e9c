"""OLMo 2 (`Olmo2ForCausalLM`): config mapping and weight rules.

Llama's attention and MLP with the norms on what each branch writes
(`placement="output"`) and full-width QK-norm.
"""

from __future__ import annotations

from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Derived,
    Rule,
    attn_rules,
    llama_like,
    llama_like_fields,
    mlp_rules,
    qk_norm_rules,
    register_llama_layout,
    understood,
)

__all__ = ["OLMO2"]

#: Every `Olmo2Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 50304,
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": Derived(lambda f: f.num_attention_heads),
    "hidden_act": "silu",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
}


def olmo2_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of an `Olmo2Config`; refuses what blocklab lacks."""
    hf = understood("Olmo2ForCausalLM", hf, FIELDS)
    return llama_like(hf, "Olmo2ForCausalLM", DecoderConfig.olmo2)


def olmo2_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Olmo2Config` fields of `cfg` (the inverse of `olmo2_config`)."""
    return dict(llama_like_fields(cfg), attention_bias=cfg.attn_bias)


def olmo2_layer(cfg: DecoderConfig) -> list[Rule]:
    """One OLMo 2 block: `norm1` / `norm2` normalize what each branch writes."""
    return [
        *attn_rules(cfg),
        *qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("norm1.weight",)),
        *mlp_rules(cfg),
        Rule("post_feedforward_layernorm.weight", ("norm2.weight",)),
    ]


OLMO2 = register_llama_layout(
    "olmo2", "Olmo2ForCausalLM", olmo2_config, olmo2_fields, olmo2_layer, FIELDS
)
