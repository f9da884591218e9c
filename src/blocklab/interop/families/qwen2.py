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

from collections.abc import Mapping
from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    LAYER_TYPES,
    Derived,
    global_layers_of,
    layer_types_of,
    llama_like,
    llama_like_fields,
    refuse,
    register_llama_layout,
    understood,
)
from .llama import llama_layer

__all__ = ["QWEN2", "qwen_config", "qwen_fields"]

_CLS = "Qwen2ForCausalLM"


def _layer_types(f: Any) -> list[str]:
    """`Qwen2Config`'s default: sliding from `max_window_layers` on, if a window."""
    sliding = f.use_sliding_window and f.sliding_window is not None
    return [
        LAYER_TYPES[1] if sliding and i >= f.max_window_layers else LAYER_TYPES[0]
        for i in range(f.num_hidden_layers)
    ]


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
    "use_sliding_window": False,
    # the class default is 4096; __post_init__ drops it without use_sliding_window
    "sliding_window": Derived(lambda f: 4096 if f.use_sliding_window else None),
    "max_window_layers": 28,
    "layer_types": Derived(_layer_types),
}


def _layer_windows(cls: str, hf: Any) -> dict[str, Any]:
    """`window` / `global_layers` of a Qwen 2 or Qwen 3 config (as read by
    `understood`), refusing sliding layers without a window."""
    full = global_layers_of(cls, hf)
    if full is None:
        return {"window": None, "global_layers": None}
    if not hf.use_sliding_window or hf.sliding_window is None:
        raise refuse(
            cls,
            "layer_types",
            list(hf.layer_types),
            "sliding layers need use_sliding_window=True and a sliding_window "
            "(transformers fails on them otherwise)",
        )
    return {"window": hf.sliding_window, "global_layers": full or None}


def qwen_config(
    cls: str, hf: Any, fields: Mapping[str, Any], **extra: Any
) -> DecoderConfig:
    """The `DecoderConfig` of the Qwen 2 or Qwen 3 config `hf` of class `cls`
    (`fields`: the family's `FIELDS`): Llama's, with a free `head_dim` and the
    sliding window; `extra`: the family's own fields. Refuses what blocklab
    lacks."""
    hf = understood(cls, hf, fields)
    windows = _layer_windows(cls, hf)
    return llama_like(
        hf, cls, DecoderConfig.llama, head_dim=hf.head_dim, **windows, **extra
    )


def qwen_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `Qwen2Config` fields of `cfg` (the inverse of `qwen_config`; Qwen 3
    adds `attention_bias`)."""
    if cfg.window is None or all(cfg.is_global(i) for i in range(cfg.num_blks)):
        window = {"use_sliding_window": False, "sliding_window": None}
    else:
        window = {"use_sliding_window": True, "sliding_window": cfg.window}
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        max_window_layers=cfg.num_blks,  # unused: layer_types is explicit
        layer_types=layer_types_of(cfg),
        **window,
    )


def qwen2_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `Qwen2Config`; refuses what blocklab lacks."""
    return qwen_config(_CLS, hf, FIELDS, attn_bias=True, attn_out_bias=False)


QWEN2 = register_llama_layout(
    "qwen2", _CLS, qwen2_config, qwen_fields, llama_layer, FIELDS
)
