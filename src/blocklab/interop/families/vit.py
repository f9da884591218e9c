r"""ViT (`ViTForImageClassification`, `ViTModel`): config and weights.

A Vision Transformer (Dosovitskiy et al., 2021) embeds an image's patches
(`nn.patch_embed.ViTEmbedding`: a stride-$p$ convolution, a CLS token,
learned positions), runs pre-norm LayerNorm blocks ($\epsilon = 10^{-12}$)
with biases and the exact GELU, layer-norms the output and classifies the
CLS token's final state linearly (no pooler in the classification model).
`ViTModel`, the base model, is an `EncoderModel` without heads: its last
hidden state is `model(images=x)`; with its pooler (`add_pooling_layer=True`,
stored as `pooler.dense.*`) `pooler_output` $= \tanh(W y_0 + b)$ is
`model.pooler_output(h)`.

`transformers` 5 renames ViT's tensors in memory (`layers.0.attention.q_proj`)
and keeps the legacy names on disk (`encoder.layer.0.attention.attention.
query`); the rules use the names on disk, and `from_huggingface` renames the
in-memory state dict first (`_disk_name`).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ...models.encoder import EncoderModel
from ...models.encoder_config import EncoderConfig
from ..hf_common import (
    BERT_ACTS,
    HF_BERT_ACTS,
    Family,
    Rule,
    label_fields,
    refuse,
    register_family,
    stack_rules,
    understood,
)

__all__ = ["VIT", "vit_config", "vit_fields", "vit_rules"]

_CLS, _BASE = "ViTForImageClassification", "ViTModel"
_ACTS, _HF_ACTS = BERT_ACTS, HF_BERT_ACTS

#: Every `ViTConfig` field blocklab understands, with its default.
FIELDS = {
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.0,  # dropout: refused in training mode
    "attention_probs_dropout_prob": 0.0,
    "layer_norm_eps": 1e-12,
    "image_size": 224,
    "patch_size": 16,
    "num_channels": 3,
    "qkv_bias": True,
    # read only by ViTForMaskedImageModeling / ViTModel's pooler
    "encoder_stride": 16,
    "pooler_output_size": None,
    "pooler_act": "tanh",
}

#: In-memory name pieces of transformers 5 -> the names on disk.
_RENAMES = (
    (r"^(vit\.)?layers\.(\d+)\.", r"\1encoder.layer.\2."),
    (r"\.attention\.q_proj\.", ".attention.attention.query."),
    (r"\.attention\.k_proj\.", ".attention.attention.key."),
    (r"\.attention\.v_proj\.", ".attention.attention.value."),
    (r"\.attention\.o_proj\.", ".attention.output.dense."),
    (r"\.mlp\.fc1\.", ".intermediate.dense."),
    (r"\.mlp\.fc2\.", ".output.dense."),
)


def _disk_name(key: str) -> str:
    for pattern, repl in _RENAMES:
        key = re.sub(pattern, repl, key)
    return key


def vit_config(hf: Any, cls: str = _CLS) -> EncoderConfig:
    """The `EncoderConfig` of a `ViTConfig`; refuses what blocklab lacks."""
    if cls not in (_CLS, _BASE):
        raise refuse(cls, "architectures", cls, f"supported: {[_CLS, _BASE]}")
    labels = getattr(hf, "id2label", None)
    num_labels = getattr(hf, "num_labels", None) or (len(labels) if labels else 2)
    hf = understood(cls, hf, FIELDS)
    if hf.hidden_act not in _ACTS:
        raise refuse(cls, "hidden_act", hf.hidden_act, f"supported: {sorted(_ACTS)}")
    for field in ("image_size", "patch_size"):
        if not isinstance(getattr(hf, field), int):
            raise refuse(
                cls, field, getattr(hf, field), "blocklab takes square images (an int)"
            )
    if cls == _BASE:  # the pooler: as the stored tensors say (`_from_keys`)
        size = hf.pooler_output_size
        if size is not None and size != hf.hidden_size:
            raise refuse(
                cls, "pooler_output_size", size,
                f"blocklab's pooler keeps the width (hidden_size={hf.hidden_size})",
            )  # fmt: skip
        if hf.pooler_act != "tanh":
            raise refuse(cls, "pooler_act", hf.pooler_act, "supported: ['tanh']")
        heads = dict(num_labels=0, pooler="tanh")
    else:
        heads = dict(num_labels=int(num_labels), pooler="none")
    return EncoderConfig(
        0,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        norm="layer",
        norm_eps=float(hf.layer_norm_eps),
        act=_ACTS[hf.hidden_act],
        placement="pre",
        bias=True,
        attn_bias=bool(hf.qkv_bias),
        attn_out_bias=True,
        ffn_width=hf.intermediate_size,
        positions="none",
        image_size=hf.image_size,
        patch_size=hf.patch_size,
        num_channels=hf.num_channels,
        final_norm=True,
        pooling="cls",
        **heads,
    )


def vit_fields(cfg: EncoderConfig) -> dict[str, Any]:
    """The `ViTConfig` fields of `cfg` (the inverse of `vit_config`)."""
    n = cfg.num_labels
    out = dict(
        hidden_size=cfg.num_hiddens,
        num_hidden_layers=cfg.num_blks,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.block.ffn_width,
        hidden_act=_HF_ACTS[cfg.block.act],
        layer_norm_eps=cfg.block.norm_eps,
        image_size=cfg.image_size,
        patch_size=cfg.patch_size,
        num_channels=cfg.num_channels,
        qkv_bias=cfg.block.attn_bias,
    )
    if n:
        out.update(label_fields(n))
    return out


def _expressible(cfg: Any) -> bool:
    if not isinstance(cfg, EncoderConfig) or cfg.image_size is None:
        return False
    b = cfg.block
    return (
        b.norm == "layer" and b.placement == "pre" and b.act in _HF_ACTS
        and b.attn_out_bias and b.ffn_bias and b.num_kv_heads == b.num_heads
        and b.head_dim * b.num_heads == b.num_hiddens
        and b.attn_scale in (None, b.head_dim**-0.5) and b.window is None
        and not b.qk_norm and b.attn_softcap is None and cfg.final_norm
        and cfg.first_attn_norm and not cfg.embed_norm and cfg.pooling == "cls"
        and (
            (cfg.num_labels > 0 and cfg.pooler == "none")
            or (cfg.num_labels == 0 and cfg.pooler in ("tanh", "none")
                and cfg.head_bias)
        )
    )  # fmt: skip


def vit_rules(cfg: EncoderConfig, cls: str = _CLS) -> list[Rule]:
    """Every stored tensor (names on disk) and its blocklab parameter."""
    p = "" if cls == _BASE else "vit."
    e = p + "embeddings."
    rules = [
        Rule(e + "cls_token", ("vit_emb.cls_token",), "lead", lead=2),
        Rule(e + "position_embeddings", ("vit_emb.pos_emb",), "lead", lead=1),
        Rule(e + "patch_embeddings.projection.weight", ("vit_emb.patch.weight",)),
        Rule(e + "patch_embeddings.projection.bias", ("vit_emb.patch.bias",)),
    ]
    b = cfg.block
    layer = [
        ("attention.attention.query", "attention.W_q", b.attn_bias),
        ("attention.attention.key", "attention.W_k", b.attn_bias),
        ("attention.attention.value", "attention.W_v", b.attn_bias),
        ("attention.output.dense", "attention.W_o", True),
        ("layernorm_before", "norm1", True),
        ("intermediate.dense", "ffn.W_1", True),
        ("output.dense", "ffn.W_2", True),
        ("layernorm_after", "norm2", True),
    ]
    rules += stack_rules(cfg.num_blks, f"{p}encoder.layer.", layer)
    for n in ("weight", "bias"):
        rules.append(Rule(f"{p}layernorm.{n}", (f"norm.{n}",)))
        if cls == _CLS:
            rules.append(Rule(f"classifier.{n}", (f"classifier.{n}",)))
        elif cfg.pooler == "tanh":
            rules.append(Rule(f"pooler.dense.{n}", (f"pooler_dense.{n}",)))
    return rules


def _from_keys(cfg: EncoderConfig, cls: str, keys: frozenset) -> EncoderConfig:
    """`ViTModel` has its pooler iff `pooler.dense.weight` is stored."""
    if cls == _BASE and "pooler.dense.weight" not in keys:
        return dataclasses.replace(cfg, pooler="none")
    return cfg


VIT = register_family(
    Family(
        name="vit",
        classes=(_CLS, _BASE),
        model_types=("vit",),
        to_config=vit_config,
        hf_fields=vit_fields,
        rules=vit_rules,
        build=lambda cfg, key: EncoderModel(cfg, key=key),
        model_class=lambda cfg: _CLS if cfg.num_labels else _BASE,
        owns=lambda m: isinstance(m, EncoderModel) and _expressible(m.cfg),
        dropout_fields=("hidden_dropout_prob", "attention_probs_dropout_prob"),
        disk_name=_disk_name,
        base_prefix="vit.",
        from_keys=_from_keys,
    )
)
