r"""Qwen 2 (`Qwen2ForCausalLM`): config mapping and weight rules.

Llama's block with biases on the query, key and value projections only
(`q_proj`, `k_proj`, `v_proj`; none on `o_proj` or the MLP: blocklab's
`attn_bias=True, attn_out_bias=False`), and an optional sliding window: with
`use_sliding_window`, layer $i$ is local (window `sliding_window`, query $q$
sees key $k$ iff $q - W < k \le q$) when $i \ge$ `max_window_layers`, unless
`layer_types` lists the layers explicitly; without it, every layer is global
and `sliding_window` is ignored (`Qwen2Config` sets it to `None`).
"""

from __future__ import annotations

from typing import Any

from ..nn.decoder_config import DecoderConfig
from .hf_common import (
    Derived,
    HFFamily,
    llama_like,
    llama_like_fields,
    model_global_rules,
    refuse,
    register_family,
    understood,
)
from .llama import llama_layer

__all__ = ["QWEN2", "layer_windows", "sliding_fields"]

_CLS = "Qwen2ForCausalLM"
_TYPES = ("full_attention", "sliding_attention")


def _layer_types(f: Any) -> list[str]:
    """`Qwen2Config`'s default: sliding from `max_window_layers` on, if a window."""
    sliding = f.use_sliding_window and f.sliding_window is not None
    return [
        _TYPES[1] if sliding and i >= f.max_window_layers else _TYPES[0]
        for i in range(f.num_hidden_layers)
    ]


#: The sliding-window fields of Qwen 2 and Qwen 3, with their defaults.
SLIDING_FIELDS = {
    "use_sliding_window": False,
    # the class default is 4096; __post_init__ drops it without use_sliding_window
    "sliding_window": Derived(lambda f: 4096 if f.use_sliding_window else None),
    "max_window_layers": 28,
    "layer_types": Derived(_layer_types),
}

#: Every `Qwen2Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 22016,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    # not a Qwen2Config field, but Qwen2Attention reads it when present
    "head_dim": Derived(lambda f: f.hidden_size // f.num_attention_heads),
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "attention_dropout": 0.0,
    "tie_word_embeddings": False,
    **SLIDING_FIELDS,
}


def layer_windows(cls: str, hf: Any) -> dict[str, Any]:
    """`window` / `global_layers` of a Qwen 2 or Qwen 3 config (as read by
    `understood`), refusing unknown layer types and sliding layers without a
    window."""
    types = list(hf.layer_types)
    if len(types) != hf.num_hidden_layers:
        raise refuse(
            cls, "layer_types", types, f"expected {hf.num_hidden_layers} entries"
        )
    unknown = sorted(set(types) - set(_TYPES))
    if unknown:
        raise refuse(
            cls, "layer_types", unknown[0], f"layer types must be one of {_TYPES}"
        )
    window = hf.sliding_window if hf.use_sliding_window else None
    if _TYPES[1] not in types:
        return {"window": None, "global_layers": None}
    if window is None:
        raise refuse(
            cls,
            "layer_types",
            types,
            "sliding layers need use_sliding_window=True and a sliding_window "
            "(transformers fails on them otherwise)",
        )
    full = tuple(i for i, t in enumerate(types) if t == _TYPES[0])
    return {"window": window, "global_layers": full or None}


def sliding_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The sliding-window fields of `cfg` (the inverse of `layer_windows`)."""
    if cfg.window is None or all(cfg.is_global(i) for i in range(cfg.num_blks)):
        return {"use_sliding_window": False, "sliding_window": None,
                "layer_types": [_TYPES[0]] * cfg.num_blks}  # fmt: skip
    return {
        "use_sliding_window": True,
        "sliding_window": cfg.window,
        "layer_types": [
            _TYPES[0] if cfg.is_global(i) else _TYPES[1] for i in range(cfg.num_blks)
        ],
    }


def qwen2_config(hf: Any) -> DecoderConfig:
    """The `DecoderConfig` of a `Qwen2Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    return llama_like(
        hf,
        _CLS,
        DecoderConfig.llama,
        head_dim=hf.head_dim,
        attn_bias=True,
        attn_out_bias=False,
        **layer_windows(_CLS, hf),
    )


def qwen2_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Qwen2Config` fields of `cfg` (the inverse of `qwen2_config`)."""
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        max_window_layers=cfg.num_blks,  # unused: layer_types is explicit
        **sliding_fields(cfg),
    )


QWEN2 = register_family(
    HFFamily(
        name="qwen2",
        classes=(_CLS,),
        to_config=qwen2_config,
        hf_fields=qwen2_fields,
        layer_prefix="model.layers.{i}.",
        layer_rules=llama_layer,
        global_rules=model_global_rules,
        fields=FIELDS,
    )
)
