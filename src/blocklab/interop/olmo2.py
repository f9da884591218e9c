"""OLMo 2 (`Olmo2ForCausalLM`): config mapping and weight rules.

Llama's attention and MLP with the norms on what each branch writes
(`placement="output"`) and full-width QK-norm.
"""

from __future__ import annotations

from typing import Any

from ..nn.decoder import DecoderConfig
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
)

__all__ = ["OLMO2"]


def olmo2_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of an `Olmo2Config`; refuses what blocklab lacks."""
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


OLMO2 = register_family(
    HFFamily(
        name="olmo2",
        classes=("Olmo2ForCausalLM",),
        to_config=olmo2_config,
        hf_fields=olmo2_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=olmo2_layer,
        global_rules=model_global_rules,
    )
)
