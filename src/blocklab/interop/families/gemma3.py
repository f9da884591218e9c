"""Gemma 3, text (`Gemma3ForCausalLM`): config mapping and weight rules.

Sandwich norms with the Gemma RMSNorm (gain $1 + w$, $w$ stored: blocklab's
`"gemma_rms"` stores the same $w$), per-head QK-norm, gated MLP, embeddings
scaled by $\\sqrt d$, local (sliding-window) and global layers with their own
RoPE bases, attention scale `query_pre_attn_scalar ** -0.5`, tied head.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    LAYER_TYPES,
    Derived,
    Rule,
    attn_rules,
    decoder_config,
    decoder_fields,
    forward_settings,
    get_field,
    global_layers_of,
    hf_gated_act,
    layer_types_of,
    mlp_rules,
    no_softcapping,
    qk_norm_rules,
    refuse,
    register_llama_layout,
    require,
    rope_fields,
    rope_theta,
    understood,
)

__all__ = ["GEMMA3"]

_CLS = "Gemma3ForCausalLM"


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """Per-layer-type RoPE parameters as `Gemma3TextConfig` folds them: the
    legacy `rope_scaling` updates the global layers', `rope_theta` and
    `rope_local_base_freq` fill a missing global / local base."""
    params = hf.rope_parameters
    if not isinstance(params, Mapping) or not set(LAYER_TYPES) >= set(params):
        raise refuse(
            _CLS, "rope_parameters", params, "expected per-layer-type rope parameters"
        )
    full = dict(params.get("full_attention") or {"rope_type": "default"})
    local = dict(params.get("sliding_attention") or {"rope_type": "default"})
    if hf.rope_scaling:
        full.update(hf.rope_scaling)
    full.setdefault("rope_theta", hf.rope_theta or 1e6)
    local.setdefault("rope_theta", hf.rope_local_base_freq or 1e4)
    return {"full_attention": full, "sliding_attention": local}


#: Every `Gemma3TextConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "hidden_act": None,  # a legacy key, read by no transformers 5 code
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "rope_theta": None,  # legacy keys, folded into rope_parameters
    "rope_local_base_freq": None,
    "rope_scaling": None,
    "rope_parameters": {
        "full_attention": {"rope_type": "default"},
        "sliding_attention": {"rope_type": "default"},
    },  # the bases: see _rope_parameters
    "attention_bias": False,
    "attention_dropout": 0.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,  # legacy: every 6th layer global
    "_sliding_window_pattern": Derived(lambda f: f.sliding_window_pattern),
    "layer_types": Derived(
        lambda f: [
            LAYER_TYPES[1] if (i + 1) % f._sliding_window_pattern else LAYER_TYPES[0]
            for i in range(f.num_hidden_layers)
        ]
    ),
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "text_config": None,
}


def gemma_config(cls: str, hf: Any, **extra: Any) -> DecoderConfig:
    """The `DecoderConfig` of what Gemma 2 and Gemma 3 configs (as read by
    `understood`) share: sandwich norms with the Gemma RMSNorm, embeddings
    scaled by $\\sqrt d$, the attention scale `query_pre_attn_scalar ** -0.5`,
    `hidden_activation`, `head_dim`, and the local and global layers of
    `layer_types` (refused if a layer is sliding without a `sliding_window`);
    refuses bidirectional attention. `extra`: the family's own fields."""
    require(
        cls,
        hf,
        "use_bidirectional_attention",
        (False, None),
        "blocklab's decoder is causal",
    )
    full = global_layers_of(cls, hf)
    if full is not None and hf.sliding_window is None:
        raise refuse(cls, "sliding_window", None, "sliding layers need a window")
    return decoder_config(
        hf,
        cls,
        DecoderConfig,
        act_field="hidden_activation",
        norm="gemma_rms",
        placement="sandwich",
        positions="rope",
        head_dim=hf.head_dim,
        attn_scale=float(hf.query_pre_attn_scalar) ** -0.5,
        embed_scale=float(hf.hidden_size) ** 0.5,
        window=None if full is None else hf.sliding_window,
        global_layers=full,
        **extra,
    )


def gemma3_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `Gemma3TextConfig`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    if get_field(hf, "text_config") is not None:
        raise refuse(
            _CLS, "text_config", "...", "convert the text model (Gemma3TextConfig) only"
        )
    no_softcapping(_CLS, hf)
    params = _rope_parameters(hf)
    theta_full = rope_theta(
        _CLS, params.get("full_attention"), "rope_parameters['full_attention']"
    )
    theta_local = rope_theta(
        _CLS, params.get("sliding_attention"), "rope_parameters['sliding_attention']"
    )
    local = LAYER_TYPES[1] in hf.layer_types  # else: no local layers, no local base
    return gemma_config(
        _CLS,
        hf,
        qk_norm="head",
        rope_theta=theta_full,
        local_rope_theta=theta_local if local else None,
    )


def query_pre_attn_scalar(scale: float) -> int | float:
    """`query_pre_attn_scalar` of the attention scale `scalar ** -0.5`: an int
    (as `Gemma2Config` and `Gemma3TextConfig` type it) when it is one to 1e-9."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) <= 1e-9 * scalar else scalar


def gemma_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The fields `gemma_config` reads, for `cfg` (the inverse of
    `gemma_config`)."""
    settings = forward_settings(cfg)
    return dict(
        decoder_fields(cfg),
        head_dim=cfg.block.head_dim,
        query_pre_attn_scalar=query_pre_attn_scalar(settings["attn_scale"]),
        hidden_activation=hf_gated_act(cfg.act),
        attention_bias=cfg.attn_bias,
        layer_types=layer_types_of(cfg),
    )


def gemma3_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Gemma3TextConfig` fields of `cfg` (the inverse of `gemma3_config`)."""
    local = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    return dict(
        gemma_fields(cfg),
        rope_parameters={
            "full_attention": rope_fields(cfg.rope_theta),
            "sliding_attention": rope_fields(local),
        },
        sliding_window=cfg.window,
        attn_logit_softcapping=None,
        final_logit_softcapping=None,
        use_bidirectional_attention=False,
    )


def gemma3_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Gemma 3 block: a norm before and after each branch."""
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *attn_rules(cfg),
        *qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("out_norm1.weight",)),
        Rule("pre_feedforward_layernorm.weight", ("norm2.weight",)),
        *mlp_rules(cfg),
        Rule("post_feedforward_layernorm.weight", ("out_norm2.weight",)),
    ]


GEMMA3 = register_llama_layout(
    "gemma3",
    _CLS,
    gemma3_config,
    gemma3_fields,
    gemma3_layer,
    FIELDS,
    model_types=("gemma3_text",),
)
