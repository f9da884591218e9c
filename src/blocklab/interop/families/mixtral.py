r"""Mixtral (sparse mixture of experts) for `DecoderLM` and `from_huggingface`.

`blocklab.models.MoEDecoderConfig` builds a Mixtral-style `DecoderLM`. Importing
this module registers the `"mixtral"` family, so `blocklab.from_huggingface`
converts a PyTorch `MixtralForCausalLM`:

- attention as Llama's (RoPE, grouped-query heads, no biases), with Mixtral's
  `sliding_window` (when set) on every layer;
- `mlp.gate.weight` $(E, d)$ is the router; `mlp.experts.gate_up_proj`
  $(E, 2I, d)$ holds each expert's gate ($W_g$, the first $I$ rows) and up
  ($W_1$) projections; `mlp.experts.down_proj` $(E, d, I)$ is $W_2$;
- routing: softmax of the router logits in float32, top-`num_experts_per_tok`,
  renormalized (`routing="mixtral"`). `router_jitter_noise` acts only in
  training mode, so a model in training mode with jitter is refused.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...models.decoder_config import DecoderConfig
from ...models.moe_decoder import MoEDecoderConfig
from ..hf_common import (
    Rule,
    StoredAs,
    attn_rules,
    get_field,
    llama_like,
    llama_like_fields,
    pre_norm_layer,
    refuse,
    register_llama_layout,
    understood,
)

__all__ = ["MIXTRAL"]

#: Every `MixtralConfig` field blocklab understands, with its default.
FIELDS = {
    "vocab_size": 32000,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": None,
    "hidden_act": "silu",
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
    "sliding_window": None,
    "attention_dropout": 0.0,
    "num_experts_per_tok": 2,
    "num_local_experts": 8,
    "router_jitter_noise": 0.0,  # training mode only (refused there)
    "output_router_logits": False,  # the auxiliary loss only
    "router_aux_loss_coef": 0.001,  # the auxiliary loss only
    "tie_word_embeddings": False,
}


def mixtral_config(hf: Any, cls: str | None = None) -> MoEDecoderConfig:
    """The `MoEDecoderConfig` of a `MixtralConfig`; refuses what blocklab lacks."""
    cls = "MixtralForCausalLM"
    hf = understood(cls, hf, FIELDS)
    E = get_field(hf, "num_local_experts")
    k = get_field(hf, "num_experts_per_tok")
    for field, value in (("num_local_experts", E), ("num_experts_per_tok", k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise refuse(cls, field, value, "expected a positive int")
    if k > E:
        raise refuse(
            cls,
            "num_experts_per_tok",
            k,
            f"more experts per token than num_local_experts={E}",
        )
    return llama_like(
        hf,
        cls,
        MoEDecoderConfig.llama,
        head_dim=get_field(hf, "head_dim"),
        window=get_field(hf, "sliding_window"),
        num_experts=E,
        top_k=k,
        routing="mixtral",
    )


def mixtral_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `MixtralConfig` fields of `cfg` (the inverse of `mixtral_config`;
    Mixtral has no attention or expert biases, and one window for every layer)."""
    return dict(
        llama_like_fields(cfg),
        head_dim=cfg.block.head_dim,
        sliding_window=cfg.window,
        # A dense config: one expert, so that the difference is named.
        num_local_experts=getattr(cfg, "num_experts", 1),
        num_experts_per_tok=getattr(cfg, "top_k", 1),
    )


def mixtral_layer(cfg: DecoderConfig) -> list[Rule]:
    """One Mixtral block: Llama's attention and norms, the router `mlp.gate` and
    the fused experts (`gate_up_proj` holds W_g then W_1 along axis 1)."""
    moe = [
        Rule("mlp.gate.weight", ("ffn.router.weight",)),
        Rule(
            "mlp.experts.gate_up_proj",
            ("ffn.experts.W_g.weight", "ffn.experts.W_1.weight"),
            "cat1",
        ),
        Rule("mlp.experts.down_proj", ("ffn.experts.W_2.weight",)),
    ]
    return pre_norm_layer(attn_rules(cfg), moe)


def mixtral_stored(cfg: DecoderConfig) -> dict[str, StoredAs]:
    """How Mixtral checkpoint files store the experts (`transformers` writes
    this layout and fuses it on load): per layer, the router as
    `block_sparse_moe.gate.weight` and per expert e `experts.e.w1.weight`
    (gate, $W_g$), `w3` (up, $W_1$) and `w2` (down, $W_2$)."""
    E = getattr(cfg, "num_experts", 1)

    def gate_up(i: int) -> StoredAs:
        old = f"model.layers.{i}.block_sparse_moe.experts."
        w1 = tuple(f"{old}{e}.w1.weight" for e in range(E))
        w3 = tuple(f"{old}{e}.w3.weight" for e in range(E))

        def split(x):
            half = x.shape[1] // 2
            return [*x[:, :half], *x[:, half:]]

        return StoredAs(
            w1 + w3,
            lambda a: np.concatenate([np.stack(a[:E]), np.stack(a[E:])], axis=1),
            split,
        )

    out = {}
    for i in range(cfg.num_blks):
        new, old = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[new + "gate.weight"] = StoredAs(
            (old + "gate.weight",), lambda a: a[0], lambda x: [x]
        )
        out[new + "experts.gate_up_proj"] = gate_up(i)
        out[new + "experts.down_proj"] = StoredAs(
            tuple(f"{old}experts.{e}.w2.weight" for e in range(E)),
            np.stack,
            list,
        )
    return out


MIXTRAL = register_llama_layout(
    "mixtral",
    "MixtralForCausalLM",
    mixtral_config,
    mixtral_fields,
    mixtral_layer,
    FIELDS,
    dropout_fields=("attention_dropout", "router_jitter_noise"),
    stored_as=mixtral_stored,
)
