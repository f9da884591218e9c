r"""`MoEDecoderConfig`: a decoder whose FFNs are top-k mixtures of experts.

`DecoderLM(MoEDecoderConfig(...))` is a Mixtral-style model: every block's FFN
is a `MoEFeedForward`, built through `TransformerBlock`'s `ffn_factory` hook;
the router statistics come from `moe.moe_forward`, the auxiliary losses from
`blocklab.training.moe_loss`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from .._validate import check_choice, check_int
from ..nn.moe import DISPATCHES, ROUTINGS, MoEFeedForward
from .decoder_config import DecoderConfig

__all__ = ["MoEDecoderConfig"]

_OWNER = "MoEDecoderConfig"


@dataclasses.dataclass(frozen=True, init=False, eq=False)
class MoEDecoderConfig(DecoderConfig):
    """A `DecoderConfig` whose FFNs are top-k mixtures of experts.

    Attributes (besides `DecoderConfig`'s):
        num_experts: experts per block $E$.
        top_k: experts per token $k$ ($1 \\le k \\le E$).
        routing: `"mixtral"` (renormalized top-k) or `"softmax_topk"`.
        dispatch: `"dense"` or `"sorted"` (see `MoEFeedForward`).

    Each expert is a `FeedForward` of the block's activation `act`, width
    `ffn_width` and biases `ffn_bias`.
    """

    num_experts: int = 8
    top_k: int = 2
    routing: str = "mixtral"
    dispatch: str = "dense"

    def _check(self) -> None:
        super()._check()

        def put(name, value):
            object.__setattr__(self, name, value)

        put("num_experts", check_int(_OWNER, "num_experts", self.num_experts, min=1))
        put(
            "top_k",
            check_int(_OWNER, "top_k", self.top_k, min=1, max=self.num_experts),
        )
        put("routing", check_choice(_OWNER, "routing", self.routing, ROUTINGS))
        put("dispatch", check_choice(_OWNER, "dispatch", self.dispatch, DISPATCHES))

    def ffn_factory(self, *, key: Any) -> MoEFeedForward:
        """The FFN of every block (`TransformerBlock`'s `ffn_factory` hook)."""
        block = self.block
        return MoEFeedForward(
            block.num_hiddens,
            self.num_experts,
            self.top_k,
            act=block.act,
            width=block.ffn_width,
            routing=self.routing,
            dispatch=self.dispatch,
            bias=block.ffn_bias,
            key=key,
        )

    @classmethod
    def mixtral(
        cls,
        vocab_size: int = 128,
        num_hiddens: int = 64,
        num_heads: int = 4,
        num_blks: int = 2,
        *,
        num_experts: int = 8,
        top_k: int = 2,
        num_kv_heads: int | None = 2,
        max_len: int = 128,
        **overrides: Any,
    ) -> MoEDecoderConfig:
        """Mixtral: Llama's block (pre-norm RMSNorm eps 1e-5, RoPE theta 1e6,
        grouped-query attention, untied head) with top-k SwiGLU experts."""
        fields = dict(
            norm_eps=1e-5, rope_theta=1e6, num_experts=num_experts, top_k=top_k,
            routing="mixtral",
        )  # fmt: skip
        return cls.llama(
            vocab_size, num_hiddens, num_heads, num_blks, num_kv_heads=num_kv_heads,
            max_len=max_len, **{**fields, **overrides},
        )  # fmt: skip
