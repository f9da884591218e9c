r"""Phi-3 (`Phi3ForCausalLM`): config mapping and weight rules.

Llama's block with fused projections: `self_attn.qkv_proj.weight`
$(Hp + 2Kp, d)$ stacks the query ($Hp$ rows), key ($Kp$) and value ($Kp$)
projections, and `mlp.gate_up_proj.weight` $(2I, d)$ the gate (first $I$
rows, $W_g$) and up ($W_1$) projections: split on import, fused on export.
RMSNorm eps 1e-5, an optional `sliding_window` on every layer (as Mistral's).
The long-RoPE scaling (`rope_type` `"longrope"`, and its legacy names
`"su"` and `"yarn"`) and partial rotary embeddings
(`partial_rotary_factor` $\ne 1$) are refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Derived,
    Rule,
    llama_like,
    pre_norm_layer,
    refuse,
    register_llama_layout,
    understood,
)
from .mistral import mistral_fields

__all__ = ["PHI3"]

_CLS = "Phi3ForCausalLM"
#: Phi-3's scaled RoPE variants (`Phi3Config` rewrites "su" and "yarn" to it).
LONG_ROPE = ("longrope", "su", "yarn")

#: Every `Phi3Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 32064,
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": Derived(lambda f: f.num_attention_heads),
    # not a Phi3Config field, but Phi3Attention reads it when present
    "head_dim": Derived(lambda f: f.hidden_size // f.num_attention_heads),
    "hidden_act": "silu",
    "max_position_embeddings": 4096,
    # read only by the long-RoPE scaling, which is refused
    "original_max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 1.0,
    },  # fmt: skip
    "partial_rotary_factor": 1.0,  # legacy top-level key, moved into rope_parameters
    "sliding_window": None,
    "attention_dropout": 0.0,
    "resid_pdrop": 0.0,
    "embd_pdrop": 0.0,
    "tie_word_embeddings": False,
}


def phi3_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `Phi3Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    for field in ("rope_parameters", "rope_scaling"):
        params = getattr(hf, field, None)
        if isinstance(params, Mapping):
            kind = params.get("rope_type", params.get("type"))
            if kind in LONG_ROPE:
                raise refuse(
                    _CLS,
                    f"{field}['rope_type']",
                    kind,
                    "Phi-3's long-RoPE scaling (longrope; 'su' and 'yarn' are its "
                    "legacy names) is not implemented",
                )
    if hf.partial_rotary_factor != 1.0:
        raise refuse(
            _CLS,
            "partial_rotary_factor",
            hf.partial_rotary_factor,
            "blocklab rotates every feature of each head",
        )
    return llama_like(
        hf,
        _CLS,
        DecoderConfig.llama,
        head_dim=hf.head_dim,
        window=hf.sliding_window,
    )


def phi3_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Phi-3 block: Llama's, with `qkv_proj` and `gate_up_proj` fused."""
    b = cfg.block
    q, kv = b.num_heads * b.head_dim, b.num_kv_heads * b.head_dim
    qkv = tuple(f"attention.W_{n}.weight" for n in "qkv")
    attn = [
        Rule("self_attn.qkv_proj.weight", qkv, "cat", (q, kv, kv)),
        Rule("self_attn.o_proj.weight", ("attention.W_o.weight",)),
    ]
    mlp = [
        Rule("mlp.gate_up_proj.weight", ("ffn.W_g.weight", "ffn.W_1.weight"), "cat"),
        Rule("mlp.down_proj.weight", ("ffn.W_2.weight",)),
    ]
    return pre_norm_layer(attn, mlp)


PHI3 = register_llama_layout(
    "phi3",
    _CLS,
    phi3_config,
    mistral_fields,  # Phi-3's inverse is Mistral's: `head_dim`, one window
    phi3_layer,
    FIELDS,
    dropout_fields=("attention_dropout", "resid_pdrop"),
    variant_of="mistral",
)
