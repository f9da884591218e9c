"""`Stack`: N blocks of one structure as one stacked pytree, applied by `lax.scan`."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_key
from .hooks import Hooks
from .kv_cache import write_cache
from .mask import Mask
from .remat import NamedSites, check_remat, nested_groups, parse_remat

__all__ = ["PerLayer", "Stack"]


class PerLayer(eqx.Module):
    r"""A block input that differs per layer, computed inside the stack's scan.

    Block $i$ receives $f(\ell_i, s)$: `layers` is a pytree whose array
    leaves have a leading axis of size N, scanned with the blocks (block $i$
    reads its slice $\ell_i$), and `shared` is the same for every block.
    umT5's relative position bias is one: $\ell_i$ is layer $i$'s bias
    table, $s$ the buckets of the (query, key) pairs, $f$ the gather.
    """

    layers: Any
    shared: Any
    fn: Callable[[Any, Any], Any] = eqx.field(static=True)


def _layer_xs(owner: str, num_blks: int, layer_inputs: Any):
    """`(xs, make)`: the scanned part of `layer_inputs` and `make(xs_i)`, the
    block keywords of one layer from its slice."""
    layer_inputs = {k: v for k, v in (layer_inputs or {}).items() if v is not None}
    if not layer_inputs:
        return None, lambda _: {}
    names = tuple(layer_inputs)
    parts = tuple(
        v.layers if isinstance(v, PerLayer) else v for v in layer_inputs.values()
    )
    for name, part in zip(names, parts, strict=True):
        for leaf in jax.tree_util.tree_leaves(part):
            if eqx.is_array(leaf) and (leaf.ndim < 1 or leaf.shape[0] != num_blks):
                raise ConfigError(
                    f"{owner}: layer input {name!r} must have a leading axis of "
                    f"size num_blks={num_blks} (one slice per block), got a leaf "
                    f"of shape {tuple(leaf.shape)}."
                )
    dynamic, static = eqx.partition(parts, eqx.is_array)
    given = tuple(layer_inputs.values())

    def make(xs_i):
        out = {}
        for name, v, part in zip(names, given, eqx.combine(xs_i, static), strict=True):
            out[name] = v.fn(part, v.shared) if isinstance(v, PerLayer) else part
        return out

    return dynamic, make


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
    remat: bool | str | Callable[..., Any] = eqx.field(static=True)
    unroll: int | bool = eqx.field(static=True)
    #: `constrain(h)` applied to the hidden state at every block boundary
    #: (before each block and after the last), e.g. a sharding constraint
    #: (`blocklab.training.placement`); `None`: nothing is applied (no cost).
    constrain: Callable[[Array], Array] | None = eqx.field(static=True, default=None)

    def __init__(
        self,
        make_block: Callable[[PRNGKeyArray], Any],
        num_blks: int,
        *,
        remat: Any = False,
        unroll: int | bool = 1,
        key: PRNGKeyArray,
    ):
        """Args:
        make_block: `make_block(key)` returns one block, called as
            `block(x, mask, key=...)`.
        num_blks: depth N >= 1.
        remat: what the backward pass keeps (`blocklab.nn.remat`): `False`
            or `"none"` keeps every activation; `True` or `"full"`
            rematerializes each block (`jax.checkpoint`): activation memory
            O(1) blocks instead of O(N), for about one extra forward pass;
            `"dots"`, `"names:SITE,..."`, `"offload:SITE,..."`,
            `"nested"` or a `jax.checkpoint_policies` callable keep what
            the policy says.
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
        remat = check_remat("Stack", remat)
        if not isinstance(unroll, (bool, np.bool_, int, np.integer)) or (
            not isinstance(unroll, (bool, np.bool_)) and unroll < 1
        ):
            raise ConfigError(
                f"Stack: unroll must be a positive int or a bool, got {unroll!r}."
            )
        unroll = bool(unroll) if isinstance(unroll, np.bool_) else unroll
        unroll = int(unroll) if isinstance(unroll, np.integer) else unroll
        self.num_blks, self.remat, self.unroll = num_blks, remat, unroll
        # Set explicitly: Equinox flattens a module whose __dict__ lacks a field
        # with its wrapper attributes, and then `__name__` comes back as Missing.
        self.constrain = None
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

    def unstack(self) -> tuple:
        """The N blocks as a tuple of ordinary modules, each leaf sliced once.

        For loops that run the blocks many times (`generate`'s decode loop):
        sliced before the loop, every block's weights are buffers of their
        own, where a scan over the stacked leaves slices (and on a CPU copies)
        them again at every iteration. A program that calls the blocks one
        after another grows with depth, which a scan does not.
        """
        return tuple(self.block(i) for i in range(self.num_blks))

    def with_constraint(self, constrain: Callable[[Array], Array] | None) -> Stack:
        """This stack with `constrain(h)` applied at every block boundary.

        $h_k = B_k(c(h_{k-1}))$ and the output is $c(h_N)$: `constrain` must
        be the identity on values (a `jax.lax.with_sharding_constraint`), and
        hashable (it is part of the compiled program). `None` removes it.
        """
        new = copy.copy(self)
        object.__setattr__(new, "constrain", constrain)
        return new

    def __len__(self) -> int:
        return self.num_blks

    def scan(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
        collect: Callable[[Any, Array, Array | None], Any] | None = None,
        hooks: Hooks | None = None,
        layer_inputs: Mapping[str, Any] | None = None,
        **inputs: Any,
    ) -> tuple[Float[Array, "*batch T d"], Any]:
        """Run the stack, optionally collecting per-block values out of the scan.

        Args:
            x, mask, positions, key, hooks: as for `__call__`.
            layer_inputs, inputs: as for `__call__`.
            collect: `collect(block, h, key) -> (h_next, stats)`, applied instead
                of `block(h, mask, key=key)`; `stats` (any pytree) is
                stacked over the blocks. `None` collects nothing. Not with
                `hooks` or `layer_inputs`.

        Returns:
            `(h_N, stats)` with a leading axis of size N on every leaf of `stats`.
        """
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        keys = None if key is None else jax.random.split(key, self.num_blks)
        extra = {} if positions is None else {"positions": positions}
        extra.update({k: v for k, v in inputs.items() if v is not None})
        if hooks is not None and collect is not None:
            raise ConfigError("Stack.scan: pass collect or hooks, not both.")
        if layer_inputs and collect is not None:
            raise ConfigError("Stack.scan: pass collect or layer_inputs, not both.")
        layers = None if hooks is None else jnp.arange(self.num_blks, dtype=jnp.int32)
        per_xs, per_layer = _layer_xs("Stack", self.num_blks, layer_inputs)

        constrain = self.constrain
        policy = parse_remat("Stack", self.remat)
        # A policy that reads checkpoint names gets them from the sites.
        named, seen = policy.tags and collect is None, set()

        def step(h, xs):
            blk_params, k, i, per_i = xs
            blk = eqx.combine(blk_params, static)
            kw = {**extra, **per_layer(per_i)}
            if constrain is not None:
                h = constrain(h)
            if hooks is not None or named:
                mine = None if hooks is None else hooks.stacked(i)
                mine = NamedSites(mine, seen) if named else mine
                out = blk(h, mask, key=k, hooks=mine, **kw)
                return out, (None if hooks is None else mine.values)
            if collect is None:
                return blk(h, mask, key=k, **kw), None
            return collect(blk, h, k)

        h, stats = _remat_scan(
            policy, step, x, (dynamic, keys, layers, per_xs), self.num_blks,
            self.unroll,
        )  # fmt: skip
        missing = [n for n in policy.full_names if named and n not in seen]
        if missing:
            raise ConfigError(
                f"Stack: remat={self.remat!r} names {missing}, which the blocks "
                f"do not carry on this path; they carry {sorted(seen)}."
            )
        if hooks is not None:
            hooks.values.update(stats)
            stats = None
        return (h if constrain is None else constrain(h)), stats

    def __call__(
        self,
        x: Float[Array, "*batch T d"],
        mask: Mask | Int[ArrayLike, ""] | Int[ArrayLike, "*#batch #T"] | None = None,
        *,
        positions: Int[ArrayLike, "*#batch #T"] | None = None,
        key: PRNGKeyArray | None = None,
        hooks: Hooks | None = None,
        layer_inputs: Mapping[str, Any] | None = None,
        **inputs: Any,
    ) -> Float[Array, "*batch T d"]:
        """Apply the N blocks in order to a sequence `x` of shape `(T, d)` (or a batch).

        `mask` (a `blocklab.nn.mask.Mask`, built once by the model, or the
        chapter's `valid_lens`) is passed to every block, and `positions`
        (RoPE) too when given, and so are the other block inputs given as
        keywords (`inputs`, e.g. `score_bias`, an encoder's `context` and
        its `cross_mask`: the same for every block,
        not scanned over). `layer_inputs` maps block keywords to inputs
        that differ per block, scanned with the blocks: a pytree whose
        arrays have a leading axis of size N (block i gets slice i), or a
        `PerLayer` (block i gets `fn(layers_i, shared)`). `key` (dropout) is
        split into one subkey per block. `hooks` (`blocklab.nn.hooks`) sees
        the blocks' sites as `blocks.*.<site>` (`TransformerBlock.__call__`),
        with the block index as the edits' `layer`; what it records comes
        out of the scan stacked over the blocks, `(N, ...)`.
        """
        return self.scan(
            x, mask, positions=positions, key=key, hooks=hooks,
            layer_inputs=layer_inputs, **inputs,
        )[0]  # fmt: skip

    def step(
        self,
        x: Float[Array, "*batch Tq d"],
        caches: Any,
        start: Int[ArrayLike, "*#batch"],
        *,
        hooks: Hooks | None = None,
        cross_kv: Any = None,
        layer_inputs: Mapping[str, Any] | None = None,
        **inputs: Any,
    ) -> tuple[Float[Array, "*batch Tq d"], Any]:
        """Apply the N blocks to new tokens against their key/value caches.

        $h_k, c_k' = B_k.\\mathrm{step}(h_{k-1}, c_k, \\text{start})$: the
        caches of the N blocks are one pytree whose leaves have a leading axis
        of size N (what `blocks.attention.init_cache` gives, stacked), scanned
        together with the block parameters as data, so the compiled step, like
        `__call__`, does not grow with depth.

        Args:
            x: `(Tq, d)` new tokens (or a batch `(..., Tq, d)`), the first at
                cache index `start`.
            caches: the stacked per-block caches.
            start: int, or one per sequence (shape `x.shape[:-2]`).
            hooks: as for `__call__` (the sites of `TransformerBlock.step`).
            cross_kv: cross-attention blocks' cached encoder keys and values,
                stacked over the blocks like `caches` (scanned with them).
            layer_inputs: keywords of `TransformerBlock.step` that differ per
                block, scanned with them (as for `__call__`).
            inputs: other keywords of `TransformerBlock.step`, the same for
                every block (`cross_mask`, `score_bias`, ...).

        Returns:
            `(h_N, new_caches)`, the caches stacked as they came in.
        """
        dynamic, static = eqx.partition(self.blocks, eqx.is_array)
        steps = jnp.arange(self.num_blks, dtype=jnp.int32)
        given = {k: v for k, v in inputs.items() if v is not None}
        per_xs, per_layer = _layer_xs("Stack.step", self.num_blks, layer_inputs)

        def run(blk, h, cache, i, ckv, per_i, **kw):
            kw.update(given)
            kw.update(per_layer(per_i))
            if ckv is not None:
                kw["cross_kv"] = ckv
            if hooks is None:
                return blk.step(h, cache, start, **kw), None
            mine = hooks.stacked(i)
            return blk.step(h, cache, start, hooks=mine, **kw), mine.values

        if x.shape[-2] == 1:
            # Decoding: the caches are read in the layer loop and written once
            # after it (`defer_write`); written inside it, XLA copies them.
            def read_only(h, xs):
                blk_params, i, ckv, per_i = xs
                cache = jax.tree.map(
                    lambda c: jax.lax.dynamic_index_in_dim(c, i, keepdims=False),
                    caches,
                )
                blk = eqx.combine(blk_params, static)
                (h, rows), seen = run(blk, h, cache, i, ckv, per_i, defer_write=True)
                return h, (rows, seen)

            h, (rows, seen) = jax.lax.scan(
                read_only, x, (dynamic, steps, cross_kv, per_xs), unroll=self.unroll
            )
            new = write_cache(caches, rows, start, stacked=True)
        else:

            def body(h, xs):
                blk_params, cache, i, ckv, per_i = xs
                blk = eqx.combine(blk_params, static)
                (h, cache), seen = run(blk, h, cache, i, ckv, per_i)
                return h, (cache, seen)

            layers = None if hooks is None else steps
            h, (new, seen) = jax.lax.scan(
                body, x, (dynamic, caches, layers, cross_kv, per_xs),
                unroll=self.unroll,
            )  # fmt: skip
        if hooks is not None:
            hooks.values.update(seen)
        return h, new


def _remat_scan(policy, step, x, xs, num_blks, unroll):
    """`lax.scan(step, x, xs)` with the blocks rematerialized as `policy` says
    (`blocklab.nn.remat`). Inside a scan `prevent_cse` is not needed (the
    loop already keeps XLA from merging the recomputation into the forward)."""
    if not policy.checkpoints:
        return jax.lax.scan(step, x, xs, unroll=unroll)
    if policy.kind != "nested":
        body = jax.checkpoint(step, prevent_cse=False, policy=policy.jax_policy())
        return jax.lax.scan(body, x, xs, unroll=unroll)
    # Square-root remat: an outer scan over groups of g blocks keeps only the
    # group inputs; each group, recomputed, keeps its block inputs.
    g, G, r = nested_groups(num_blks)
    inner = jax.checkpoint(step, prevent_cse=False)

    @functools.partial(jax.checkpoint, prevent_cse=False)
    def group(h, xs_g):
        return jax.lax.scan(inner, h, xs_g, unroll=unroll)

    def head(a):
        a = a if r == 0 else a[: G * g]
        return a.reshape(G, g, *a.shape[1:])

    h, stats = jax.lax.scan(group, x, jax.tree_util.tree_map(head, xs))
    stats = jax.tree_util.tree_map(lambda a: a.reshape(G * g, *a.shape[2:]), stats)
    if r:
        h, more = group(h, jax.tree_util.tree_map(lambda a: a[G * g :], xs))
        stats = jax.tree_util.tree_map(
            lambda a, b: jnp.concatenate([a, b]), stats, more
        )
    return h, stats
