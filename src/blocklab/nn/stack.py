"""`Stack`: N blocks of one structure as one stacked pytree, applied by `lax.scan`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_key

__all__ = ["Stack"]


class Stack(eqx.Module):
    r"""N blocks of one structure as one stacked pytree, applied by `lax.scan`.

    $$h_0 = x,\qquad h_k = B_k(h_{k-1}),\quad k = 1, \ldots, N.$$

    The blocks are built by `eqx.filter_vmap(make_block)` over N keys, so every
    array leaf gains a leading block axis of size N and the forward pass is one
    `jax.lax.scan`: compile time does not grow with depth. `stack.block(i)` (or
    `stack[i]`) returns block i as an ordinary module.

    With `unroll=k` each iteration of the scan applies k blocks (`lax.scan`'s
    `unroll`): compile time grows with k, not N, and the scan's per-iteration
    bookkeeping (stacking every block's saved activations for the backward
    pass) is paid N/k times. On CPU that bookkeeping is about a fifth of a
    two-block training step, so small stacks are best fully unrolled.
    """

    blocks: Any
    num_blks: int = eqx.field(static=True)
    remat: bool = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)

    def __init__(
        self,
        make_block: Callable[[PRNGKeyArray], Any],
        num_blks: int,
        *,
        remat: bool = False,
        unroll: int | bool = 1,
        key: PRNGKeyArray,
    ):
        """Args:
        make_block: `make_block(key)` returns one block, called as
            `block(x, valid_lens, key=...)`.
        num_blks: depth N >= 1.
        remat: rematerialize each block in the backward pass
            (`jax.checkpoint`): activation memory O(1) blocks instead of O(N),
            for about one extra forward pass of compute.
        unroll: blocks applied per scan iteration, a positive int, or `True`
            for all N (no loop) and `False` for 1.
        key: PRNG key; block k is built from the k-th of `num_blks` subkeys.
        """
        key = check_key("Stack", "key", key)
        if (
            isinstance(num_blks, (bool, np.bool_))
            or not isinstance(num_blks, (int, np.integer))
            or num_blks < 1
        ):
            raise ConfigError(
                f"Stack: num_blks must be a positive int, got {num_blks!r}."
            )
        num_blks = int(num_blks)
        remat = check_bool("Stack", "remat", remat)
        if not isinstance(unroll, (bool, np.bool_, int, np.integer)) or (
            not isinstance(unroll, (bool, np.bool_)) and unroll < 1
        ):
            raise ConfigError(
                f"Stack: unroll must be a positive int or a bool, got {unroll!r}."
            )
        unroll = bool(unroll) if isinstance(unroll, np.bool_) else unroll
        unroll = int(unroll) if isinstance(unroll, np.integer) else unroll
        self.num_blks, self.remat, self.unroll = num_blks, remat, unroll
        # One compiled program for all N initializations: much faster to build
        # than dispatching every random draw of every block eagerly.
        build = eqx.filter_jit(eqx.filter_vmap(make_block))
        self.blocks = build(jax.random.split(key, num_blks))

    def block(self, i: int):
        """Block `i` (0-based; negative counts from the top) as an ordinary module."""
        if not -self.num_blks <= i < self.num_blks:
            raise IndexError(
                f"block index {i} out of range for a Stack of {self.num_blks}."
            )
        return jax.tree_util.tree_map(
            lambda leaf: leaf[i] if eqx.is_array(leaf) else leaf, self.blocks
        )

    def __getitem__(self, i: int):
        return self.block(i)

    def __len__(self) -> int:
        return self.num_blks

    def scan(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
        collect: Callable[[Any, Array, Array | None], Any] | None = None,
    ) -> tuple[Float[Array, "*batch T d"], Any]:
        """Run the stack, optionally collecting per-block values out of the scan.

        Args:
            x, valid_lens, positions, key: as for `__call__`.
            collect: `collect(block, h, key) -> (h_next, stats)`, applied instead
                of `block(h, valid_lens, key=key)`; `stats` (any pytree) is
                stacked over the blocks. `None` collects nothing.

        Returns:
            `(h_N, stats)` with a leading axis of size N on every leaf of `stats`.
        """
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.num_blks)
        extra = {} if positions is None else {"positions": positions}

        def step(h, xs):
            blk_params, k = xs
            blk = eqx.combine(blk_params, static)
            if collect is None:
                return blk(h, valid_lens, key=k, **extra), None
            return collect(blk, h, k)

        if self.remat:
            step = jax.checkpoint(step)
        return jax.lax.scan(step, x, (dynamic, keys), unroll=self.unroll)

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        valid_lens: Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "*batch T d"]:
        """Apply the N blocks in order to a sequence `x` of shape `(T, d)` (or a batch).

        `valid_lens` is passed to every block, and `positions` (RoPE) too when
        given; `key` (dropout) is split into one subkey per block.
        """
        return self.scan(x, valid_lens, positions=positions, key=key)[0]
