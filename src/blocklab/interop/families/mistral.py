r"""Mistral (`MistralForCausalLM`): config mapping and weight rules.

Llama's block (pre-norm RMSNorm, SwiGLU, RoPE, grouped-query attention, no
biases, untied head) with one sliding window on every layer: query $q$ sees
key $k$ iff $q - W < k \le q$ (`sliding_window` $= W$; `null`: causal
attention over everything). The window **defaults to 4096** in
`MistralConfig`, so a `config.json` without the key is a windowed model.
"""

from __future__ import annotations

from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Derived,
    get_field,
    llama_like,
    llama_like_fields,
    refuse,
    register_llama_layout,
    understood,
)
from .llama import llama_layer

__all__ = ["MISTRAL"]

_CLS = "MistralForCausalLM"

#: Every `MistralConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": Derived(lambda f: f.hidden_size // f.num_attention_heads),
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "sliding_window": 4096,
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    # refused unless at their default (see `mistral_config`)
    "layer_types": None,
    "attention_bias": False,
    "mlp_bias": False,
}


def mistral_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `MistralConfig`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    if hf.layer_types is not None:
        # MistralConfig stores it with a warning; its masks ignore it
        raise refuse(
            _CLS,
            "layer_types",
            hf.layer_types,
            "Mistral's masks apply sliding_window to every layer and ignore "
            "layer_types",
        )
    for name in ("attention_bias", "mlp_bias"):
        if get_field(hf, name):
            raise refuse(
                _CLS, name, get_field(hf, name), "Mistral's projections have no bias"
            )
    return llama_like(
        hf,
        _CLS,
        DecoderConfig.llama,
        head_dim=hf.head_dim or hf.hidden_size // hf.num_attention_heads,
        window=hf.sliding_window,
    )


def mistral_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `MistralConfig` fields of `cfg` (the inverse of `mistral_config`):
    the window of the first layer, which a Mistral applies to all of them."""
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        sliding_window=cfg.window if cfg.layer_windows()[0] else None,
    )


MISTRAL = register_llama_layout(
    "mistral",
    _CLS,
    mistral_config,
    mistral_fields,
    llama_layer,
    FIELDS,
    variant_of="llama",
)
