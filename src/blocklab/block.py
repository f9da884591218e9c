"""The configurable transformer block."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import equinox as eqx
import jax
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .attention import AttentionTrace, MultiHeadAttention, check_config
from .ffn import ACTS, FeedForward
from .functional import dropout
from .norms import NORMS, LayerNorm, RMSNorm, make_norm

__all__ = ["TransformerBlock", "BlockTrace", "PLACEMENTS"]

#: The valid values of the `placement` option.
PLACEMENTS = ("post", "pre", "output", "sandwich")


class BlockTrace(NamedTuple):
    """What one block call computes, for diagnostics.

    Attributes:
        output: `(T, d)`, the block's output.
        attn_out: `(T, d)`, what the attention branch adds to the stream (after
            its output norm and dropout, where the placement has them).
        ffn_out: `(T, d)`, likewise for the FFN branch.
        attention: the attention's `AttentionTrace`, or `None` when a custom
            attention module has no `trace` method.

    For a batch `(..., T, d)` every field gains the same leading axes.
    """

    output: Array
    attn_out: Array
    ffn_out: Array
    attention: AttentionTrace | None


class TransformerBlock(eqx.Module):
    r"""Attention and an FFN on a residual stream, with a choice of norm placement.

    Writing $F$ for a sublayer (attention, then the FFN) and $N$, $N'$ for
    norms, each sublayer updates the stream $x$ as

    - `"post"` (Vaswani et al., 2017): $x \leftarrow N(x + F(x))$
    - `"pre"` (GPT-2, Llama; Xiong et al., 2020): $x \leftarrow x + F(N(x))$
    - `"output"` (OLMo 2): $x \leftarrow x + N(F(x))$
    - `"sandwich"` (Gemma 3): $x \leftarrow x + N'(F(N(x)))$

    Only `"post"` normalizes the stream's identity path. Norms are `norm1`,
    `norm2` (the branch-output norms of `"sandwich"` are `out_norm1`,
    `out_norm2`). Dropout acts on each branch output when a `key` is passed.

    The defaults (pre-norm, RMSNorm, SwiGLU, no bias) are the modern open-weights
    block; `norm="layer", act="gelu", placement="post", bias=True` is the 2017
    encoder block (with GELU for ReLU).
    """

    norm1: RMSNorm | LayerNorm
    norm2: RMSNorm | LayerNorm
    out_norm1: RMSNorm | LayerNorm | None
    out_norm2: RMSNorm | LayerNorm | None
    attention: Any
    ffn: Any
    num_hiddens: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    norm: str = eqx.field(static=True)
    act: str = eqx.field(static=True)
    placement: str = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        dropout: float = 0.0,
        norm: str = "rms",
        act: str = "swiglu",
        placement: str = "pre",
        bias: bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        attn_factory: Callable[..., Any] | None = None,
        ffn_factory: Callable[..., Any] | None = None,
        key: PRNGKeyArray,
    ):
        """Args:
        num_hiddens: model width $d$.
        num_heads: attention heads; must divide `num_hiddens`.
        dropout: rate for attention weights and both branch outputs.
        norm: `"rms"` or `"layer"`.
        act: one of `"relu"`, `"gelu"`, `"gelu_exact"`, `"swiglu"`, `"geglu"`,
            `"reglu"`, `"bilinear"`.
        placement: `"post"`, `"pre"`, `"output"` or `"sandwich"`.
        bias: biases in the attention and FFN projections.
        qk_norm: RMS-normalize queries and keys per head (default attention).
        norm_eps: the $\\epsilon$ of the block's norms (PyTorch's LayerNorm uses
            1e-5: set it when porting such weights exactly).
        attn_factory: `attn_factory(key=...)` returns the attention module,
            called as `attn(x, valid_lens, key=...)`; replaces the default.
        ffn_factory: `ffn_factory(key=...)` returns the FFN module, called as
            `ffn(x, key=...)`; replaces the default.
        key: PRNG key for the weights.
        """
        check_config("TransformerBlock", num_hiddens, num_heads, dropout)
        if norm not in NORMS:
            raise ValueError(
                f"TransformerBlock: norm must be one of {sorted(NORMS)}, "
                f"got norm={norm!r}."
            )
        if act not in ACTS:
            raise ValueError(
                f"TransformerBlock: act must be one of {list(ACTS)}, got act={act!r}."
            )
        if placement not in PLACEMENTS:
            raise ValueError(
                f"TransformerBlock: placement must be one of {list(PLACEMENTS)}, "
                f"got placement={placement!r}."
            )
        self.num_hiddens, self.num_heads = num_hiddens, num_heads
        self.norm, self.act = norm, act
        self.placement, self.dropout = placement, dropout
        attn_key, ffn_key = jax.random.split(key)

        def new_norm():
            return make_norm(norm, num_hiddens, norm_eps)

        self.norm1, self.norm2 = new_norm(), new_norm()
        sandwich = placement == "sandwich"
        self.out_norm1 = new_norm() if sandwich else None
        self.out_norm2 = new_norm() if sandwich else None
        self.attention = (
            MultiHeadAttention(
                num_hiddens,
                num_heads,
                bias=bias,
                qk_norm=qk_norm,
                dropout=dropout,
                key=attn_key,
            )
            if attn_factory is None
            else attn_factory(key=attn_key)
        )
        self.ffn = (
            FeedForward(num_hiddens, act, bias=bias, key=ffn_key)
            if ffn_factory is None
            else ffn_factory(key=ffn_key)
        )

    def _sublayer(self, x, branch_fn, norm, out_norm, key):
        """One residual sublayer; returns (new stream, what the branch wrote)."""
        reads_normed = self.placement in ("pre", "sandwich")
        branch = branch_fn(norm(x) if reads_normed else x)
        if self.placement == "output":
            branch = norm(branch)
        elif self.placement == "sandwich":
            branch = out_norm(branch)
        branch = dropout(branch, self.dropout, key)
        if self.placement == "post":
            return norm(x + branch), branch
        return x + branch, branch

    def trace(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " T"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> BlockTrace:
        """Run the block, returning its output and the intermediate values.

        The one implementation of the forward pass (`__call__` returns its
        `.output`); see `BlockTrace`.
        """
        if x.ndim < 2 or x.shape[-1] != self.num_hiddens:
            raise ValueError(
                f"TransformerBlock acts on a sequence x of shape (T, "
                f"num_hiddens={self.num_hiddens}) (or a batch (..., T, "
                f"num_hiddens)), got x.shape={tuple(x.shape)}."
            )
        k_attn, k_drop1, k_drop2 = (
            (None,) * 3 if key is None else jax.random.split(key, 3)
        )
        attn_trace = None

        def attend(y):
            nonlocal attn_trace
            if hasattr(self.attention, "trace"):
                attn_trace = self.attention.trace(y, valid_lens, key=k_attn)
                return attn_trace.output
            return self.attention(y, valid_lens, key=k_attn)

        x, attn_out = self._sublayer(x, attend, self.norm1, self.out_norm1, k_drop1)
        x, ffn_out = self._sublayer(x, self.ffn, self.norm2, self.out_norm2, k_drop2)
        return BlockTrace(x, attn_out, ffn_out, attn_trace)

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " T"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch T d"]:
        """Apply the block to one sequence, or to each of a batch.

        Args:
            x: `(T, num_hiddens)`, or a batch `(..., T, num_hiddens)` whose
                sequences share `valid_lens` (for per-sequence lengths,
                `jax.vmap` over the batch instead). A batch gives the same
                values as `jax.vmap`, computed as one matrix product per
                projection (`blocklab.functional.linear`).
            valid_lens: `None`, a scalar, or `(T,)` per-query lengths
                (`jnp.arange(1, T + 1)` is causal). Masked keys never give NaN.
            key: enables dropout; `None` is deterministic (evaluation).

        Returns:
            The shape and dtype of `x`.
        """
        return self.trace(x, valid_lens, key=key).output
