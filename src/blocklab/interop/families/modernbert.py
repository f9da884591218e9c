r"""ModernBERT (`ModernBertModel`, `ModernBertForMaskedLM`,
`ModernBertForSequenceClassification`).

ModernBERT (Warner et al., 2024) is a pre-norm encoder without biases (its
LayerNorms too, unless `norm_bias`): a layer-normed token embedding (no
positions added), RoPE with one base for the global layers (160000) and
another for the local ones (10000), GeGLU with the exact GELU on the first
half of the fused `Wi`, and alternating attention: layer $i$ is global when
$i \bmod n = 0$ (`global_attn_every_n_layers` $n = 3$, or `layer_types`),
else local, where key $k$ is visible from query $q$ iff $|q - k| \le
a/2$ for `local_attention` $a$ (blocklab: a bidirectional window $w = a/2 +
1$, $|q - k| < w$). Layer 0 reads the stream without an attention norm (the
embedding's norm stands in for it). The MLM head is
$\mathrm{LN}(\mathrm{gelu}(h W_t^\top))\, E^\top + b$; classification pools
the CLS token or the mean over unmasked tokens and applies the same
transform before a linear classifier. `ModernBertModel`, the base model,
is an `EncoderModel` without heads: `model(ids)` is its last hidden state
(after the final norm).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ...models.encoder import EncoderModel
from ...models.encoder_config import EncoderConfig
from ..hf_common import (
    LAYER_TYPES,
    Family,
    Rule,
    label_fields,
    refuse,
    register_family,
    rope_theta,
    understood,
)

__all__ = ["MODERNBERT", "modernbert_config", "modernbert_fields", "modernbert_rules"]

_MLM, _SEQ = "ModernBertForMaskedLM", "ModernBertForSequenceClassification"
_BASE = "ModernBertModel"
_ACTS = {"gelu": "geglu_exact", "gelu_new": "geglu", "gelu_pytorch_tanh": "geglu",
         "silu": "swiglu", "relu": "reglu"}  # fmt: skip
_HF_ACTS = {v: k for k, v in _ACTS.items() if k != "gelu_pytorch_tanh"}
_HEAD_ACTS = {"gelu": "gelu_exact", "gelu_new": "gelu", "relu": "relu"}
_HF_HEAD_ACTS = {v: k for k, v in _HEAD_ACTS.items()}

#: Every `ModernBertConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 50368,
    "hidden_size": 768,
    "intermediate_size": 1152,
    "num_hidden_layers": 22,
    "num_attention_heads": 12,
    "hidden_activation": "gelu",
    "max_position_embeddings": 8192,
    "initializer_range": 0.02,
    "initializer_cutoff_factor": 2.0,
    "norm_eps": 1e-5,
    "norm_bias": False,
    "attention_bias": False,
    "attention_dropout": 0.0,  # dropout: refused in training mode
    "embedding_dropout": 0.0,
    "mlp_dropout": 0.0,
    "classifier_dropout": 0.0,
    "layer_types": None,
    # None in a legacy config.json: global_rope_theta / local_rope_theta
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
    },
    "local_attention": 128,
    "mlp_bias": False,
    "decoder_bias": True,
    "classifier_pooling": "cls",
    "classifier_bias": False,
    "classifier_activation": "gelu",
    "tie_word_embeddings": True,
    "cls_token_id": None,
    # the loss's settings (only with labels), and kernels' switches
    "sparse_prediction": False,
    "sparse_pred_ignore_index": -100,
    "deterministic_flash_attn": False,
    "reference_compile": None,
    "repad_logits_with_grad": False,
    # keys of the original checkpoints' config.json that no transformers 5
    # code reads (the norms use norm_eps; the positions are RoPE)
    "layer_norm_eps": None,
    "position_embedding_type": None,
    "gradient_checkpointing": False,
    # legacy keys folded into layer_types / rope_parameters, as transformers does
    "global_attn_every_n_layers": 3,
    "global_rope_theta": 160000.0,
    "local_rope_theta": 10000.0,
}


def _layer_types(cls: str, hf: Any) -> list[str]:
    types = hf.layer_types
    if types is None:
        n = hf.global_attn_every_n_layers
        return [
            LAYER_TYPES[0] if i % n == 0 else LAYER_TYPES[1]
            for i in range(hf.num_hidden_layers)
        ]
    types = list(types)
    if len(types) != hf.num_hidden_layers or set(types) - set(LAYER_TYPES):
        raise refuse(
            cls,
            "layer_types",
            types,
            f"expected {hf.num_hidden_layers} entries of {list(LAYER_TYPES)}",
        )
    return types


def _thetas(cls: str, hf: Any, params: Any) -> tuple[float, float]:
    """The global and local RoPE bases: `params` (the config's own
    `rope_parameters`), else the legacy `global_rope_theta` /
    `local_rope_theta`."""
    if params is None:
        return float(hf.global_rope_theta), float(hf.local_rope_theta)
    if not isinstance(params, Mapping) or set(params) - set(LAYER_TYPES):
        raise refuse(
            cls, "rope_parameters", params, f"expected one dict per {LAYER_TYPES}"
        )
    full = rope_theta(cls, params.get(LAYER_TYPES[0]), "rope_parameters")
    local = rope_theta(cls, params.get(LAYER_TYPES[1]), "rope_parameters")
    return full, local


def modernbert_config(hf: Any, cls: str = _MLM) -> EncoderConfig:
    """The `EncoderConfig` of a `ModernBertConfig`; refuses what blocklab lacks."""
    labels = getattr(hf, "id2label", None)
    num_labels = getattr(hf, "num_labels", None) or (len(labels) if labels else 2)
    pad = getattr(hf, "pad_token_id", None)
    params = getattr(hf, "rope_parameters", None)
    hf = understood(cls, hf, FIELDS)
    if hf.hidden_activation not in _ACTS:
        raise refuse(
            cls,
            "hidden_activation",
            hf.hidden_activation,
            f"supported: {sorted(_ACTS)}",
        )
    if hf.classifier_activation not in _HEAD_ACTS:
        raise refuse(
            cls,
            "classifier_activation",
            hf.classifier_activation,
            f"supported: {sorted(_HEAD_ACTS)}",
        )
    if hf.norm_bias:
        raise refuse(cls, "norm_bias", True, "blocklab converts bias-free norms only")
    if hf.hidden_size % hf.num_attention_heads:
        raise refuse(
            cls,
            "num_attention_heads",
            hf.num_attention_heads,
            "must divide hidden_size",
        )
    types = _layer_types(cls, hf)
    full, local = _thetas(cls, hf, params)
    sliding = LAYER_TYPES[1] in types
    if sliding and hf.local_attention % 2:
        raise refuse(
            cls, "local_attention", hf.local_attention, "expected an even window"
        )
    window = dict(
        window=hf.local_attention // 2 + 1,
        window_mode="bidirectional",
        global_layers=tuple(i for i, t in enumerate(types) if t == LAYER_TYPES[0]),
        local_rope_theta=local,
    ) if sliding else {}  # fmt: skip
    if cls == _MLM:
        heads = dict(
            mlm_head=True,
            tie_embeddings=bool(hf.tie_word_embeddings),
            decoder_bias=bool(hf.decoder_bias),
        )
    elif cls == _SEQ:
        if hf.classifier_pooling not in ("cls", "mean"):
            raise refuse(
                cls, "classifier_pooling", hf.classifier_pooling, "cls or mean"
            )
        heads = dict(
            num_labels=int(num_labels),
            pooler="transform",
            pooling=hf.classifier_pooling,
        )
    elif cls == _BASE:
        heads = {}
    else:
        raise refuse(cls, "architectures", cls, f"supported: {[_MLM, _SEQ, _BASE]}")
    return EncoderConfig(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        norm="layer",
        norm_eps=float(hf.norm_eps),
        act=_ACTS[hf.hidden_activation],
        placement="pre",
        attn_bias=bool(hf.attention_bias),
        ffn_bias=bool(hf.mlp_bias),
        ffn_width=hf.intermediate_size,
        max_len=hf.max_position_embeddings,
        positions="rope",
        rope_theta=full,
        embed_norm=True,
        first_attn_norm=False,
        final_norm=True,
        head_act=_HEAD_ACTS[hf.classifier_activation],
        head_bias=bool(hf.classifier_bias),
        pad_token_id=pad if isinstance(pad, int) and 0 <= pad < hf.vocab_size else None,
        **window,
        **heads,
    )


def modernbert_fields(cfg: EncoderConfig) -> dict[str, Any]:
    """The `ModernBertConfig` fields of `cfg` (the inverse of
    `modernbert_config`)."""
    b = cfg.block
    windows = cfg.layer_windows()
    types = [LAYER_TYPES[0] if w == 0 else LAYER_TYPES[1] for w in windows]
    thetas = cfg.layer_thetas()
    full = b.rope_theta
    local = cfg.local_rope_theta if cfg.local_rope_theta is not None else full
    out = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.num_hiddens,
        intermediate_size=b.ffn_width,
        num_hidden_layers=cfg.num_blks,
        num_attention_heads=cfg.num_heads,
        hidden_activation=_HF_ACTS[b.act],
        max_position_embeddings=cfg.max_len,
        norm_eps=b.norm_eps,
        norm_bias=False,
        attention_bias=b.attn_bias,
        mlp_bias=b.ffn_bias,
        layer_types=types,
        rope_parameters={
            LAYER_TYPES[0]: {"rope_type": "default", "rope_theta": full},
            LAYER_TYPES[1]: {"rope_type": "default", "rope_theta": local},
        },
        local_attention=2 * (b.window - 1) if b.window else 128,
        decoder_bias=cfg.decoder_bias,
        classifier_pooling=cfg.pooling,
        classifier_bias=cfg.head_bias,
        classifier_activation=_HF_HEAD_ACTS[cfg.head_act],
        tie_word_embeddings=cfg.tie_embeddings,
        pad_token_id=cfg.pad_token_id,
        bos_token_id=None,
        eos_token_id=None,
        cls_token_id=None,
        sep_token_id=None,
    )
    del thetas
    if cfg.num_labels:
        out.update(label_fields(cfg.num_labels))
    return out


def _expressible(cfg: Any) -> bool:
    if not isinstance(cfg, EncoderConfig) or cfg.image_size is not None:
        return False
    b = cfg.block
    head_ok = (
        (cfg.mlm_head and cfg.num_labels == 0)
        or (not cfg.mlm_head and cfg.num_labels > 0 and cfg.pooler == "transform")
        or (not cfg.mlm_head and cfg.num_labels == 0 and cfg.pooler == "none")
    )
    return (
        head_ok and b.norm == "layer" and b.placement == "pre" and b.act in _HF_ACTS
        and b.attn_bias == b.attn_out_bias and b.num_kv_heads == b.num_heads
        and b.head_dim * b.num_heads == b.num_hiddens
        and b.attn_scale in (None, b.head_dim**-0.5)
        and (b.window is None or (b.window_mode == "bidirectional" and b.window >= 1))
        and not b.qk_norm and b.attn_softcap is None and cfg.positions == "rope"
        and cfg.embed_norm and not cfg.first_attn_norm and cfg.final_norm
        and cfg.type_vocab_size == 0 and cfg.head_act in _HF_HEAD_ACTS
    )  # fmt: skip


def modernbert_rules(cfg: EncoderConfig, cls: str = _MLM) -> list[Rule]:
    """Every stored tensor and its blocklab parameter."""
    b = cfg.block
    m = "" if cls == _BASE else "model."
    rules = [
        Rule(m + "embeddings.tok_embeddings.weight", ("token_emb.weight",)),
        Rule(m + "embeddings.norm.weight", ("emb_norm.weight",)),
    ]
    for i in range(cfg.num_blks):
        h, o = f"{m}layers.{i}.", f"stack.blocks.{i}."
        if i > 0:
            rules.append(Rule(h + "attn_norm.weight", (o + "norm1.weight",)))
        qkv = tuple(f"{o}attention.W_{n}.weight" for n in "qkv")
        rules.append(Rule(h + "attn.Wqkv.weight", qkv, "cat"))
        rules.append(Rule(h + "attn.Wo.weight", (o + "attention.W_o.weight",)))
        if b.attn_bias:
            qkv_b = tuple(f"{o}attention.W_{n}.bias" for n in "qkv")
            rules.append(Rule(h + "attn.Wqkv.bias", qkv_b, "cat"))
            rules.append(Rule(h + "attn.Wo.bias", (o + "attention.W_o.bias",)))
        rules.append(Rule(h + "mlp_norm.weight", (o + "norm2.weight",)))
        wi = (o + "ffn.W_g.weight", o + "ffn.W_1.weight")
        rules.append(Rule(h + "mlp.Wi.weight", wi, "cat"))
        rules.append(Rule(h + "mlp.Wo.weight", (o + "ffn.W_2.weight",)))
        if b.ffn_bias:
            wi_b = (o + "ffn.W_g.bias", o + "ffn.W_1.bias")
            rules.append(Rule(h + "mlp.Wi.bias", wi_b, "cat"))
            rules.append(Rule(h + "mlp.Wo.bias", (o + "ffn.W_2.bias",)))
    rules.append(Rule(m + "final_norm.weight", ("norm.weight",)))
    if cls == _BASE:
        return rules
    dense, norm = ("mlm_dense", "mlm_norm") if cls == _MLM else (
        "pooler_dense", "pooler_norm"
    )  # fmt: skip
    rules.append(Rule("head.dense.weight", (f"{dense}.weight",)))
    if cfg.head_bias:
        rules.append(Rule("head.dense.bias", (f"{dense}.bias",)))
    rules.append(Rule("head.norm.weight", (f"{norm}.weight",)))
    if cls == _MLM:
        if cfg.decoder_bias:
            rules.append(Rule("decoder.bias", ("mlm_bias",)))
        if not cfg.tie_embeddings:
            rules.append(Rule("decoder.weight", ("mlm_decoder.weight",)))
    else:
        for n in ("weight", "bias"):
            rules.append(Rule(f"classifier.{n}", (f"classifier.{n}",)))
    return rules


def _constants(cfg: EncoderConfig, cls: str) -> dict[str, float]:
    """The bias-free LayerNorms' biases (0) and layer 0's unused attention
    norm (gain 1, bias 0)."""
    norms = ["emb_norm", "norm"]
    if cls != _BASE:
        norms.append("mlm_norm" if cls == _MLM else "pooler_norm")
    norms += [f"stack.blocks.{i}.{n}" for i in range(cfg.num_blks)
              for n in ("norm1", "norm2")]  # fmt: skip
    out = {f"{n}.bias": 0.0 for n in norms}
    out["stack.blocks.0.norm1.weight"] = 1.0
    return out


def _tied(cfg: EncoderConfig, cls: str) -> dict[str, str]:
    if cls == _MLM and cfg.tie_embeddings:
        return {"decoder.weight": "model.embeddings.tok_embeddings.weight"}
    return {}


MODERNBERT = register_family(
    Family(
        name="modernbert",
        classes=(_MLM, _SEQ, _BASE),
        model_types=("modernbert",),
        to_config=modernbert_config,
        hf_fields=modernbert_fields,
        rules=modernbert_rules,
        build=lambda cfg, key: EncoderModel(cfg, key=key),
        model_class=lambda cfg: (
            _MLM if cfg.mlm_head else _SEQ if cfg.num_labels else _BASE
        ),
        owns=lambda m: isinstance(m, EncoderModel) and _expressible(m.cfg),
        dropout_fields=(
            "attention_dropout",
            "embedding_dropout",
            "mlp_dropout",
            "classifier_dropout",
        ),  # fmt: skip
        tied=_tied,
        constants=_constants,
        base_prefix="model.",
    )
)
