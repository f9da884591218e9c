r"""BERT (`BertModel`, `BertForMaskedLM`, `BertForSequenceClassification`):
config and weights.

BERT (Devlin et al., 2019) is the 2017 encoder: learned absolute positions
and token types summed with the token embedding and layer-normed,
post-norm blocks $x \leftarrow \mathrm{LN}(x + F(x))$ with biases everywhere
and the exact (erf) GELU, LayerNorm $\epsilon = 10^{-12}$. The masked-LM
head is $\mathrm{LN}(\mathrm{gelu}(h W_t^\top + b_t))\, E^\top + b$ (decoder
tied to the word embedding); sequence classification reads
$\tanh(W_p h_0 + b_p)$, the pooled first (CLS) token, into a linear
classifier. Position ids are $0, \ldots, T-1$ (not shifted by padding).

`BertModel`, the base model, is an `EncoderModel` without heads: its last
hidden state is `model(ids)`, and with its pooler (`add_pooling_layer=True`,
`EncoderConfig(pooler="tanh")`) `pooler_output` is
`model.pooler_output(h)`. `config.json` does not say whether a `BertModel`
has its pooler; its tensors do (a folder or state dict without
`pooler.dense.*` gives a model without the pooler).
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["BERT", "bert_config", "bert_fields", "bert_rules"]

_MLM, _SEQ = "BertForMaskedLM", "BertForSequenceClassification"
_BASE = "BertModel"

#: `hidden_act` -> blocklab's `act` (BERT's "gelu" is the exact erf GELU).
_ACTS, _HF_ACTS = BERT_ACTS, HF_BERT_ACTS

#: Every `BertConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,  # dropout: refused in training mode
    "attention_probs_dropout_prob": 0.1,
    "classifier_dropout": None,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "is_decoder": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    # a legacy key BERT 5.x no longer reads: anything but "absolute" refused
    "position_embedding_type": "absolute",
    "gradient_checkpointing": False,  # a legacy key of old config.json files
}


def bert_config(hf: Any, cls: str = _MLM) -> EncoderConfig:
    """The `EncoderConfig` of a `BertConfig` for the class `cls`; refuses
    (by name) what blocklab does not implement."""
    labels = getattr(hf, "id2label", None)
    num_labels = getattr(hf, "num_labels", None) or (len(labels) if labels else 2)
    pad = getattr(hf, "pad_token_id", None)
    hf = understood(cls, hf, FIELDS)
    if hf.hidden_act not in _ACTS:
        raise refuse(cls, "hidden_act", hf.hidden_act, f"supported: {sorted(_ACTS)}")
    if hf.position_embedding_type not in ("absolute", None):
        raise refuse(
            cls,
            "position_embedding_type",
            hf.position_embedding_type,
            "transformers 5 implements absolute positions only, and so does blocklab",
        )
    for field in ("is_decoder", "add_cross_attention"):
        if getattr(hf, field):
            raise refuse(cls, field, True, "blocklab converts BERT as an encoder")
    heads = {}
    if cls == _MLM:
        heads = dict(mlm_head=True, tie_embeddings=bool(hf.tie_word_embeddings))
    elif cls == _SEQ:
        heads = dict(num_labels=int(num_labels), pooler="tanh", pooling="cls")
    elif cls == _BASE:  # the pooler: as the stored tensors say (`_from_keys`)
        heads = dict(pooler="tanh", pooling="cls")
    else:
        raise refuse(cls, "architectures", cls, f"supported: {[_MLM, _SEQ, _BASE]}")
    return EncoderConfig(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        norm="layer",
        norm_eps=float(hf.layer_norm_eps),
        act=_ACTS[hf.hidden_act],
        placement="post",
        bias=True,
        ffn_width=hf.intermediate_size,
        max_len=hf.max_position_embeddings,
        positions="learned",
        type_vocab_size=hf.type_vocab_size,
        embed_norm=True,
        final_norm=False,
        head_act=_ACTS[hf.hidden_act],
        pad_token_id=pad if isinstance(pad, int) and 0 <= pad < hf.vocab_size else None,
        **heads,
    )


def bert_fields(cfg: EncoderConfig) -> dict[str, Any]:
    """The `BertConfig` fields of `cfg` (the inverse of `bert_config`)."""
    out = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.num_hiddens,
        num_hidden_layers=cfg.num_blks,
        num_attention_heads=cfg.num_heads,
        intermediate_size=cfg.block.ffn_width,
        hidden_act=_HF_ACTS[cfg.block.act],
        max_position_embeddings=cfg.max_len,
        type_vocab_size=cfg.type_vocab_size,
        layer_norm_eps=cfg.block.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=cfg.pad_token_id,
    )
    if cfg.num_labels:
        out.update(label_fields(cfg.num_labels))
    return out


def _expressible(cfg: Any) -> bool:
    """Whether `cfg` is a BERT: what `bert_config` builds, at any sizes."""
    if not isinstance(cfg, EncoderConfig):
        return False
    b = cfg.block
    head_ok = (cfg.mlm_head and cfg.num_labels == 0) or (
        not cfg.mlm_head and cfg.num_labels > 0 and cfg.pooler == "tanh"
        and cfg.pooling == "cls"
    ) or (
        not cfg.mlm_head and cfg.num_labels == 0
        and cfg.pooler in ("tanh", "none") and cfg.pooling == "cls"
    )  # fmt: skip
    return (
        head_ok
        and b.norm == "layer" and b.placement == "post" and b.act in _HF_ACTS
        and b.attn_bias and b.ffn_bias and b.attn_out_bias
        and b.num_kv_heads == b.num_heads and b.head_dim * b.num_heads == b.num_hiddens
        and b.attn_scale in (None, b.head_dim**-0.5) and b.window is None
        and b.rope_theta is None and not b.qk_norm and b.attn_softcap is None
        and cfg.positions == "learned" and cfg.embed_norm and not cfg.final_norm
        and cfg.first_attn_norm and cfg.type_vocab_size >= 1
        and cfg.image_size is None and cfg.head_act == b.act and cfg.head_bias
        and cfg.decoder_bias
    )  # fmt: skip


def bert_rules(cfg: EncoderConfig, cls: str) -> list[Rule]:
    """Every stored tensor of the class `cls` and its blocklab parameter."""
    p = "" if cls == _BASE else "bert."
    rules = [
        Rule(p + "embeddings.word_embeddings.weight", ("token_emb.weight",)),
        Rule(p + "embeddings.position_embeddings.weight", ("pos_emb.weight",)),
        Rule(p + "embeddings.token_type_embeddings.weight", ("type_emb.weight",)),
    ]
    for n in ("weight", "bias"):
        rules.append(Rule(f"{p}embeddings.LayerNorm.{n}", (f"emb_norm.{n}",)))
    layer = [
        ("attention.self.query", "attention.W_q", True),
        ("attention.self.key", "attention.W_k", True),
        ("attention.self.value", "attention.W_v", True),
        ("attention.output.dense", "attention.W_o", True),
        ("attention.output.LayerNorm", "norm1", True),
        ("intermediate.dense", "ffn.W_1", True),
        ("output.dense", "ffn.W_2", True),
        ("output.LayerNorm", "norm2", True),
    ]
    rules += stack_rules(cfg.num_blks, f"{p}encoder.layer.", layer)
    if cls == _MLM:
        t = "cls.predictions."
        for hf, ours in (("transform.dense", "mlm_dense"),
                         ("transform.LayerNorm", "mlm_norm")):  # fmt: skip
            for n in ("weight", "bias"):
                rules.append(Rule(f"{t}{hf}.{n}", (f"{ours}.{n}",)))
        rules.append(Rule(t + "bias", ("mlm_bias",)))
        if not cfg.tie_embeddings:
            rules.append(Rule(t + "decoder.weight", ("mlm_decoder.weight",)))
    elif cls == _SEQ:
        for n in ("weight", "bias"):
            rules.append(Rule(f"{p}pooler.dense.{n}", (f"pooler_dense.{n}",)))
            rules.append(Rule(f"classifier.{n}", (f"classifier.{n}",)))
    elif cfg.pooler == "tanh":
        for n in ("weight", "bias"):
            rules.append(Rule(f"pooler.dense.{n}", (f"pooler_dense.{n}",)))
    return rules


def _model_class(cfg: EncoderConfig) -> str:
    return _MLM if cfg.mlm_head else _SEQ if cfg.num_labels else _BASE


def _from_keys(cfg: EncoderConfig, cls: str, keys: frozenset) -> EncoderConfig:
    """`BertModel` has its pooler iff `pooler.dense.weight` is stored."""
    if cls == _BASE and "pooler.dense.weight" not in keys:
        return dataclasses.replace(cfg, pooler="none")
    return cfg


def _unused(cls: str) -> tuple[str, ...]:
    """What `BertForMaskedLM` leaves out of a pre-training checkpoint: the
    pooler and the next-sentence head (`transformers` drops them too)."""
    return ("bert.pooler.", "cls.seq_relationship.") if cls == _MLM else ()


def _tied(cfg: EncoderConfig, cls: str) -> dict[str, str]:
    if cls != _MLM:
        return {}
    out = {"cls.predictions.decoder.bias": "cls.predictions.bias"}
    if cfg.tie_embeddings:
        out["cls.predictions.decoder.weight"] = "bert.embeddings.word_embeddings.weight"
    return out


BERT = register_family(
    Family(
        name="bert",
        classes=(_MLM, _SEQ, _BASE),
        model_types=("bert",),
        to_config=bert_config,
        hf_fields=bert_fields,
        rules=bert_rules,
        build=lambda cfg, key: EncoderModel(cfg, key=key),
        model_class=_model_class,
        owns=lambda m: isinstance(m, EncoderModel) and _expressible(m.cfg),
        dropout_fields=(
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
            "classifier_dropout",
        ),  # fmt: skip
        tied=_tied,
        ignored=("bert.embeddings.position_ids", "embeddings.position_ids"),
        unused=_unused,
        base_prefix="bert.",
        from_keys=_from_keys,
    )
)
