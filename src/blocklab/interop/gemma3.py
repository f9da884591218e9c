"""Gemma 3, text (`Gemma3ForCausalLM`): config mapping and weight rules.

Sandwich norms with the Gemma RMSNorm (gain $1 + w$, $w$ stored: blocklab's
`"gemma_rms"` stores the same $w$), per-head QK-norm, gated MLP, embeddings
scaled by $\\sqrt d$, local (sliding-window) and global layers with their own
RoPE bases, attention scale `query_pre_attn_scalar ** -0.5`, tied head.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..nn.decoder_config import DecoderConfig
from .hf_common import (
    Derived,
    HFFamily,
    Rule,
    attn_rules,
    forward_settings,
    gated_act,
    get_field,
    hf_gated_act,
    mlp_rules,
    model_global_rules,
    no_softcapping,
    qk_norm_rules,
    refuse,
    register_family,
    require,
    rope_fields,
    rope_theta,
    understood,
)

__all__ = ["GEMMA3"]

_CLS = "Gemma3ForCausalLM"
_TYPES = ("full_attention", "sliding_attention")


def _rope_parameters(hf: Any) -> dict[str, Any]:
    """Per-layer-type RoPE parameters as `Gemma3TextConfig` folds them: the
    legacy `rope_scaling` updates the global layers', `rope_theta` and
    `rope_local_base_freq` fill a missing global / local base."""
    params = hf.rope_parameters
    if not isinstance(params, Mapping) or not set(_TYPES) >= set(params):
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
            _TYPES[1] if (i + 1) % f._sliding_window_pattern else _TYPES[0]
            for i in range(f.num_hidden_layers)
        ]
    ),
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "use_bidirectional_attention": False,
    "tie_word_embeddings": True,
    "text_config": None,
}


def gemma3_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of a `Gemma3TextConfig`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    if get_field(hf, "text_config") is not None:
        raise refuse(
            _CLS, "text_config", "...", "convert the text model (Gemma3TextConfig) only"
        )
    no_softcapping(_CLS, hf)
    require(
        _CLS,
        hf,
        "use_bidirectional_attention",
        (False, None),
        "blocklab's decoder is causal",
    )
    params = _rope_parameters(hf)
    theta_full = rope_theta(
        _CLS, params.get("full_attention"), "rope_parameters['full_attention']"
    )
    theta_local = rope_theta(
        _CLS, params.get("sliding_attention"), "rope_parameters['sliding_attention']"
    )
    types = list(get_field(hf, "layer_types"))
    unknown = sorted(set(types) - set(_TYPES))
    if unknown:
        raise refuse(
            _CLS,
            "layer_types",
            unknown[0],
            "layer types must be full_attention or sliding_attention",
        )
    if len(types) != hf.num_hidden_layers:
        raise refuse(
            _CLS, "layer_types", types, f"expected {hf.num_hidden_layers} entries"
        )
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = get_field(hf, "sliding_window") if sliding else None
    if sliding and window is None:
        raise refuse(_CLS, "sliding_window", None, "sliding layers need a window")
    act = gated_act(_CLS, hf, "hidden_activation")
    cfg = DecoderConfig.gemma3(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        num_kv_heads=get_field(hf, "num_key_value_heads") or hf.num_attention_heads,
        head_dim=hf.head_dim,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        max_len=hf.max_position_embeddings,
        act=act,
        norm_eps=float(hf.rms_norm_eps),
        ffn_width=hf.intermediate_size,
        attn_bias=bool(get_field(hf, "attention_bias", False)),
        rope_theta=theta_full,
        tie_embeddings=bool(get_field(hf, "tie_word_embeddings", True)),
        window=window if sliding else 1,
        global_layers=tuple(i for i, t in enumerate(types) if t == "full_attention"),
        local_rope_theta=theta_local,
    )
    if not sliding:  # every layer global: no window at all
        cfg = dataclasses.replace(
            cfg, window=None, global_layers=None, local_rope_theta=None
        )
    return cfg


def _scalar(scale: float) -> int | float:
    """`query_pre_attn_scalar` of the attention scale `scalar ** -0.5`: an int
    (as `Gemma3TextConfig` types it) when it is one to 1e-9."""
    scalar = scale**-2
    return round(scalar) if abs(scalar - round(scalar)) <= 1e-9 * scalar else scalar


def gemma3_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Gemma3TextConfig` fields of `cfg` (the inverse of `gemma3_config`)."""
    settings = forward_settings(cfg)
    local = cfg.rope_theta if cfg.local_rope_theta is None else cfg.local_rope_theta
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.num_hiddens,
        num_attention_heads=cfg.num_heads,
        num_hidden_layers=cfg.num_blks,
        num_key_value_heads=cfg.block.num_kv_heads,
        head_dim=cfg.block.head_dim,
        query_pre_attn_scalar=_scalar(settings["attn_scale"]),
        max_position_embeddings=cfg.max_len,
        hidden_activation=hf_gated_act(cfg.act),
        rms_norm_eps=cfg.norm_eps,
        intermediate_size=settings["ffn_width"],
        attention_bias=cfg.attn_bias,
        rope_parameters={
            "full_attention": rope_fields(cfg.rope_theta),
            "sliding_attention": rope_fields(local),
        },
        layer_types=[
            _TYPES[0] if cfg.is_global(i) else _TYPES[1] for i in range(cfg.num_blks)
        ],
        sliding_window=cfg.window,
        tie_word_embeddings=cfg.tie_embeddings,
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


GEMMA3 = register_family(
    HFFamily(
        name="gemma3",
        classes=(_CLS,),
        to_config=gemma3_config,
        hf_fields=gemma3_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=gemma3_layer,
        global_rules=model_global_rules,
        model_type="gemma3_text",
        fields=FIELDS,
    )
)
