"""Multi-head self-attention with optional QK-norm."""

from __future__ import annotations

import math
from typing import NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from . import init
from .functional import dropout, linear, masked_softmax
from .norms import RMSNorm

__all__ = ["MultiHeadAttention", "AttentionTrace", "check_config", "dense"]


class AttentionTrace(NamedTuple):
    """Everything one attention call computes, for diagnostics.

    Attributes:
        output: `(T, d)`, what the layer returns.
        weights: `(heads, Tq, Tk)` softmax weights (float32, before dropout).
        logits: `(heads, Tq, Tk)` scaled logits $q^\\top k / \\sqrt{p}$ (float32,
            before masking).

    For a batch `(..., T, d)` every field gains the same leading axes.
    """

    output: Array
    weights: Array
    logits: Array


def dense(
    layer: eqx.nn.Linear, x: Float[Array, "*batch n"]
) -> Float[Array, "*batch m"]:
    """Apply an `eqx.nn.Linear` to every row of `x`: $x W^\\top + b$ (`linear`)."""
    return linear(x, layer.weight, layer.bias)


def check_config(owner: str, num_hiddens: int, num_heads: int, dropout: float) -> None:
    """Validate the sizes shared by attention and the block (raises ValueError)."""
    for name, value in (("num_hiddens", num_hiddens), ("num_heads", num_heads)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}.")
    if num_hiddens % num_heads:
        raise ValueError(
            f"{owner}: num_hiddens must be divisible by num_heads, got "
            f"num_hiddens={num_hiddens}, num_heads={num_heads}; choose num_heads "
            f"among the divisors of {num_hiddens}."
        )
    if not 0.0 <= dropout < 1.0:
        raise ValueError(
            f"{owner}: dropout must be in [0, 1), got dropout={dropout!r}."
        )


class MultiHeadAttention(eqx.Module):
    r"""Multi-head scaled dot-product self-attention (Vaswani et al., 2017).

    For one sequence $X \in \mathbb R^{T\times d}$ and head $i$ of width
    $p = d/h$:
    $$Q_i = X W_q^{(i)\top},\; K_i = X W_k^{(i)\top},\; V_i = X W_v^{(i)\top},\quad
    A_i = \mathrm{softmax}_{\text{mask}}\!\Big(\frac{Q_i K_i^\top}{\sqrt p}\Big),
    \quad \mathrm{out} = [A_1 V_1, \ldots, A_h V_h]\, W_o^\top.$$

    With `qk_norm=True` (Henry et al., 2020; OLMo 2, Gemma 3, Qwen3) every
    query and key row is RMS-normalized over its $p$ features, with learned
    gains `q_norm.weight` and `k_norm.weight`, before the dot product; with unit
    gains each scaled logit then lies in $[-\sqrt p, \sqrt p]$.

    Logits and softmax are computed in float32; the output has the input's
    dtype. Dropout acts on the attention weights when a `key` is passed.
    """

    W_q: eqx.nn.Linear
    W_k: eqx.nn.Linear
    W_v: eqx.nn.Linear
    W_o: eqx.nn.Linear
    q_norm: RMSNorm | None
    k_norm: RMSNorm | None
    num_hiddens: int = eqx.field(static=True)
    num_heads: int = eqx.field(static=True)
    dropout: float = eqx.field(static=True)

    def __init__(
        self,
        num_hiddens: int,
        num_heads: int,
        *,
        bias: bool = False,
        qk_norm: bool = False,
        qk_norm_eps: float = 1e-6,
        dropout: float = 0.0,
        key: PRNGKeyArray,
    ):
        """Args:
        num_hiddens: model width $d$.
        num_heads: number of heads $h$; must divide `num_hiddens`.
        bias: give the four projections biases.
        qk_norm: RMS-normalize queries and keys per head before the scores.
        qk_norm_eps: the $\\epsilon$ of those two norms (0 makes the logits
            exactly invariant to the scale of each head's query/key weights).
        dropout: dropout rate on the attention weights.
        key: PRNG key for the weights.
        """
        check_config("MultiHeadAttention", num_hiddens, num_heads, dropout)
        self.num_hiddens, self.num_heads, self.dropout = num_hiddens, num_heads, dropout
        kq, kk, kv, ko = jax.random.split(key, 4)
        d = num_hiddens
        self.W_q = init.linear(d, d, bias=bias, key=kq)
        self.W_k = init.linear(d, d, bias=bias, key=kk)
        self.W_v = init.linear(d, d, bias=bias, key=kv)
        self.W_o = init.linear(d, d, bias=bias, key=ko)
        head_dim = d // num_heads
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm else None

    @property
    def head_dim(self) -> int:
        """$p = d / h$."""
        return self.num_hiddens // self.num_heads

    def trace(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " T"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> AttentionTrace:
        """Attend, returning the output together with its weights and logits.

        This is the one implementation; `__call__` returns its `.output`, so
        under `jit` the unused diagnostics cost nothing.
        """
        if x.ndim < 2 or x.shape[-1] != self.num_hiddens:
            raise ValueError(
                f"MultiHeadAttention acts on a sequence x of shape (T, "
                f"num_hiddens={self.num_hiddens}) (or a batch (..., T, "
                f"num_hiddens)), got x.shape={tuple(x.shape)}."
            )
        *lead, T, _ = x.shape
        h, p = self.num_heads, self.head_dim

        def heads(layer, norm):  # (..., h, T, p): heads-major, ~10% faster on CPU
            z = jnp.swapaxes(dense(layer, x).reshape(*lead, T, h, p), -3, -2)
            return z if norm is None else norm(z)

        q, k = heads(self.W_q, self.q_norm), heads(self.W_k, self.k_norm)
        v = heads(self.W_v, None)
        # float32 logits for low-precision input; float64 input stays float64.
        stat = jnp.promote_types(q.dtype, jnp.float32)
        logits = jnp.einsum(
            "...hqp,...hkp->...hqk", q, k, preferred_element_type=stat
        ) / math.sqrt(p)
        weights = masked_softmax(logits, valid_lens)
        mixed = jnp.einsum(
            "...hqk,...hkp->...hqp",
            dropout(weights, self.dropout, key).astype(v.dtype),
            v,
        )
        mixed = jnp.swapaxes(mixed, -3, -2).reshape(*lead, T, self.num_hiddens)
        out = dense(self.W_o, mixed)
        return AttentionTrace(out.astype(x.dtype), weights, logits)

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, " T"] | None = None,
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch T d"]:
        """Self-attention over one sequence, or over each of a batch.

        Args:
            x: `(T, num_hiddens)`, or a batch `(..., T, num_hiddens)` whose
                sequences share `valid_lens` (for per-sequence lengths,
                `jax.vmap` over the batch instead).
            valid_lens: `None`; a scalar (keys at positions >= it are masked for
                every query); or `(T,)` lengths, one per query
                (`jnp.arange(1, T + 1)` is causal).
            key: enables attention dropout; `None` is deterministic.

        Returns:
            The shape and dtype of `x`.
        """
        return self.trace(x, valid_lens, key=key).output
