"""GPT-2 (`GPT2LMHeadModel`): config mapping and weight rules.

GPT-2's `Conv1D` stores `(in, out)` (transposed against `nn.Linear`) and fuses
the query, key and value projections column-wise in `c_attn`; its blocks are
pre-LN LayerNorm with biases everywhere, learned positions and a tied head.
"""

from __future__ import annotations

from typing import Any

from ...models.decoder_config import DecoderConfig
from ..hf_common import (
    Family,
    Rule,
    biased,
    get_field,
    refuse,
    register_family,
    require,
    understood,
)

__all__ = ["GPT2"]

_CLS = "GPT2LMHeadModel"
#: `activation_function` -> blocklab's `act`.
_ACTS = {
    "gelu_new": "gelu",
    "gelu_pytorch_tanh": "gelu",
    "gelu": "gelu_exact",
    "relu": "relu",
}
_HF_ACTS = {"gelu": "gelu_new", "gelu_exact": "gelu", "relu": "relu"}

#: Every `GPT2Config` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,  # dropout: refused in training mode
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,  # float32 scores: the same maths
    "add_cross_attention": False,
    "tie_word_embeddings": True,
    # the summary head of GPT2DoubleHeadsModel, not the language model's
    "summary_type": "cls_index",
    "summary_use_proj": True,
    "summary_activation": None,
    "summary_proj_to_labels": True,
    "summary_first_dropout": 0.1,
    "n_ctx": None,  # a legacy key of GPT-2's config.json, read by no code
}


def gpt2_config(hf: Any, cls: str | None = None) -> DecoderConfig:
    """The `DecoderConfig` of a `GPT2Config`; refuses what blocklab lacks."""
    hf = understood(_CLS, hf, FIELDS)
    act = get_field(hf, "activation_function")
    if act not in _ACTS:
        raise refuse(_CLS, "activation_function", act, f"supported: {sorted(_ACTS)}")
    require(
        _CLS,
        hf,
        "scale_attn_by_inverse_layer_idx",
        (False, None),
        "blocklab scales every layer's scores by head_dim**-0.5 alone",
    )
    require(
        _CLS, hf, "scale_attn_weights", (True,), "blocklab always scales the scores"
    )
    require(
        _CLS,
        hf,
        "add_cross_attention",
        (False, None),
        "a decoder has no cross-attention",
    )
    return DecoderConfig.gpt2(
        hf.vocab_size,
        hf.n_embd,
        hf.n_head,
        hf.n_layer,
        max_len=hf.n_positions,
        act=_ACTS[act],
        norm_eps=float(hf.layer_norm_epsilon),
        ffn_width=hf.n_inner,
        tie_embeddings=bool(get_field(hf, "tie_word_embeddings", True)),
    )


def gpt2_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `GPT2Config` fields of `cfg` (the inverse of `gpt2_config`)."""
    return dict(
        vocab_size=cfg.vocab_size,
        n_embd=cfg.num_hiddens,
        n_head=cfg.num_heads,
        n_layer=cfg.num_blks,
        n_positions=cfg.max_len,
        activation_function=_HF_ACTS.get(cfg.act, "gelu_new"),  # other acts: named
        layer_norm_epsilon=cfg.norm_eps,
        n_inner=cfg.ffn_width,
        tie_word_embeddings=cfg.tie_embeddings,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        add_cross_attention=False,
    )


def gpt2_layer(cfg: DecoderConfig) -> list[Rule]:
    """One GPT-2 block: `ln_1`, fused `attn.c_attn`, `attn.c_proj`, `ln_2`, `mlp`."""
    att = "attention."
    return [
        Rule("ln_1.weight", ("norm1.weight",)),
        Rule("ln_1.bias", ("norm1.bias",)),
        *biased(
            [
                Rule(
                    "attn.c_attn.weight",
                    (att + "W_q.weight", att + "W_k.weight", att + "W_v.weight"),
                    "cat_T",
                ),
                Rule("attn.c_proj.weight", (att + "W_o.weight",), "T"),
            ],
            cfg.attn_bias,
        ),
        Rule("ln_2.weight", ("norm2.weight",)),
        Rule("ln_2.bias", ("norm2.bias",)),
        *biased(
            [
                Rule("mlp.c_fc.weight", ("ffn.W_1.weight",), "T"),
                Rule("mlp.c_proj.weight", ("ffn.W_2.weight",), "T"),
            ],
            cfg.ffn_bias,
        ),
    ]


def gpt2_global(cfg: DecoderConfig) -> list[Rule]:
    """`transformer.wte`, `wpe`, `ln_f` and, when untied, `lm_head`."""
    rules = [
        Rule("transformer.wte.weight", ("token_emb.weight",)),
        Rule("transformer.wpe.weight", ("pos_emb.weight",)),
        Rule("transformer.ln_f.weight", ("norm.weight",)),
        Rule("transformer.ln_f.bias", ("norm.bias",)),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("head.weight",)))
    return rules


GPT2 = register_family(
    Family(
        name="gpt2",
        classes=(_CLS,),
        to_config=gpt2_config,
        hf_fields=gpt2_fields,
        layer_prefix="transformer.h.{i}.",
        layer_rules=gpt2_layer,
        global_rules=gpt2_global,
        dropout_fields=("attn_pdrop", "resid_pdrop", "embd_pdrop"),
        fields=FIELDS,
    )
)
