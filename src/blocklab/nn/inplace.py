"""In-place (donating) normalizers: one pass over memory for a bandwidth-bound op.

`rms_norm_` and `layer_norm_` compute exactly what `blocklab.rms_norm` and
`blocklab.layer_norm` compute, but they **overwrite their input**: the array
you pass is donated to XLA (`jax.jit(..., donate_argnums=0)`), its buffer is
reused for the result, and the Python object you passed is deleted
(`x.is_deleted()` is true afterwards). The trailing underscore follows the
PyTorch convention for in-place operations.

Why. A normalizer does about 3-8 floating-point operations per element and
must read and write every element once, so it is memory-bound: its best
possible time is the time of `X -> 2X`. Two things stand between a plain
jitted norm and that limit on CPU:

1. A fresh output buffer. Allocating and first-touching a new 128 MiB array
   costs the operating system one page fault per 4 KiB page, several times
   the time of the arithmetic. Donating the input removes the allocation.
2. Donation alone does not help: XLA computes the fused norm into a new
   buffer and then *copies* it into the donated one (the reduction and the
   elementwise scaling read the input twice, so the fusion cannot write where
   it reads), which is slower than not donating at all.

The functions here loop (`lax.fori_loop`) over blocks of `block_rows` rows
that fit in the processor's cache: each step slices one block out of the
donated buffer, normalizes it with the very same `blocklab.nn.functional` code
(statistics in float32 or wider; the result agrees with the out-of-place
norm to float32 rounding, about 1e-6, since only the summation order of the
statistic may differ), and
writes it back with `dynamic_update_slice`, which XLA performs in place on a
loop-carried buffer. The input is thus read from memory once and written
once; the second read of each block (statistic, then scaling) hits the cache.

When it is safe. Only when the caller never uses `x` again: typically a
temporary activation inside your own code, or a freshly loaded batch. After
the call, `x` is deleted and touching it raises an error. On backends that
cannot donate (or for an input that is not a JAX array, e.g. a NumPy array,
which is copied to the device first) the result is still correct; only the
memory saving is lost, and JAX may warn that the donation was not usable.
Inside another `jax.jit`, call `blocklab.rms_norm` instead: the outer
computation decides about buffers, and donation applies only to top-level
calls.

What is left (`benchmarks/norms.py`; figures in benchmarks/README.md): XLA
on CPU never splits an in-place `dynamic_update_slice` over threads, so the
loop runs on one core while `2X` uses both, and the per-row reductions cost
about as much CPU time as the memory traffic. Donated, these norms stay below
the bandwidth of donated `X -> 2X`, and well ahead of the peers' donated
calls (which copy).

Recipe::

    x = blocklab.rms_norm_(x, weight)              # x is overwritten, rebind it
    y = blocklab.layer_norm_(jnp.array(h), w, b)   # keep h: donate a copy
    # never: y = rms_norm_(x); use(x)             # x is deleted
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jaxtyping import Array, Float

from .._validate import ConfigError
from .functional import check_norm_args, layer_norm, rms_norm

__all__ = ["rms_norm_", "layer_norm_", "default_block_rows"]

#: Bytes per block of rows: small enough that the block, and the temporary the
#: statistic needs, stay in a core's L2 cache between the statistic and the
#: scaling; large enough that the per-step loop overhead (about a microsecond)
#: is small next to moving the block. 128 KiB is 32 rows at d = 1024, chosen
#: with `python benchmarks/norms.py --block-rows ...` (benchmarks/README.md).
BLOCK_BYTES = 128 * 1024


def default_block_rows(d: int, itemsize: int = 4) -> int:
    """Rows per block for `d` features: about `BLOCK_BYTES` bytes, at least 1."""
    return max(1, BLOCK_BYTES // (d * itemsize))


def _blockwise(norm, x, args, block_rows):
    """Apply the row-wise `norm(block, *args)` to `x` block by block, in place.

    `x` is viewed as `(rows, d)`; `rows // block_rows` full blocks go through a
    `fori_loop` and the remaining rows (if any) through one final block of
    their own size, so no row is normalized twice. (`lax.scan` over the block
    index compiles to the same XLA while loop as this `fori_loop`; unrolling
    it 2 or 8 times made no measurable difference.)
    """
    d = x.shape[-1]
    flat = x.reshape(-1, d)
    rows = flat.shape[0]
    if rows == 0:
        return x
    block = min(block_rows, rows)
    full, rest = divmod(rows, block)

    def step(i, buf):
        start = i * block
        blk = lax.dynamic_slice_in_dim(buf, start, block, axis=0)
        return lax.dynamic_update_slice_in_dim(buf, norm(blk, *args), start, axis=0)

    flat = lax.fori_loop(0, full, step, flat)
    if rest:
        start = full * block
        tail = lax.slice_in_dim(flat, start, rows, axis=0)
        flat = lax.dynamic_update_slice_in_dim(flat, norm(tail, *args), start, axis=0)
    return flat.reshape(x.shape)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("eps", "block_rows"))
def _rms_norm_jit(x, weight, eps, block_rows):
    return _blockwise(lambda b, w: rms_norm(b, w, eps), x, (weight,), block_rows)


@functools.partial(jax.jit, donate_argnums=0, static_argnames=("eps", "block_rows"))
def _layer_norm_jit(x, weight, bias, eps, block_rows):
    return _blockwise(
        lambda b, w, c: layer_norm(b, w, c, eps), x, (weight, bias), block_rows
    )


def _check_block_rows(block_rows: int | None, x) -> int:
    if block_rows is None:
        return default_block_rows(x.shape[-1], jnp.dtype(x.dtype).itemsize)
    if (
        isinstance(block_rows, bool)
        or not isinstance(block_rows, int)
        or block_rows < 1
    ):
        raise ConfigError(
            f"block_rows must be a positive int (rows per block) or None for "
            f"the default, got {block_rows!r}."
        )
    return block_rows


def rms_norm_(
    x: Float[Array, "*batch d"],
    weight: Float[Array, " d"] | None = None,
    eps: float = 1e-6,
    *,
    block_rows: int | None = None,
) -> Float[Array, "*batch d"]:
    r"""RMSNorm over the last axis, **overwriting `x`** (donated, then deleted).

    $$\mathrm{RMSNorm}(x) = \frac{x}{\sqrt{\tfrac1d \sum_i x_i^2 + \epsilon}}
    \odot \gamma$$

    The same values as `blocklab.rms_norm(x, weight, eps)` (statistics in
    float32, or float64 for float64 input; result in the dtype of `x`),
    computed block by block in the buffer of `x` so memory is read and written
    once. Use it only when `x` is never used again (see the module docstring).

    Args:
        x: any leading axes, features last; its buffer is reused for the result.
        weight: the gain $\gamma$ of shape `(d,)`; `None` means $\gamma = 1$.
        eps: added to the mean square before the square root.
        block_rows: rows normalized per loop step; `None` picks about 128 KiB
            per block (`default_block_rows`).

    Returns:
        The normalized array, of the shape and dtype of `x`, living in the
        buffer that held `x`.
    """
    check_norm_args("rms_norm_", x, weight=weight)
    return _rms_norm_jit(
        x, weight, eps=eps, block_rows=_check_block_rows(block_rows, x)
    )


def layer_norm_(
    x: Float[Array, "*batch d"],
    weight: Float[Array, " d"] | None = None,
    bias: Float[Array, " d"] | None = None,
    eps: float = 1e-6,
    *,
    block_rows: int | None = None,
) -> Float[Array, "*batch d"]:
    r"""LayerNorm over the last axis, **overwriting `x`** (donated, then deleted).

    $$\mathrm{LayerNorm}(x) = \frac{x - \mu(x)}{\sqrt{\sigma^2(x) + \epsilon}}
    \odot \gamma + \beta$$

    The same values as `blocklab.layer_norm(x, weight, bias, eps)` (two-pass
    mean and variance in float32 or wider, result in the dtype of `x`),
    computed block by block in the buffer of `x`. Use it only when `x` is never
    used again (see the module docstring).

    Args:
        x: any leading axes, features last; its buffer is reused for the result.
        weight: the gain $\gamma$ of shape `(d,)`, or `None` for 1.
        bias: the shift $\beta$ of shape `(d,)`, or `None` for 0.
        eps: added to the (biased) variance before the square root.
        block_rows: rows normalized per loop step; `None` picks about 128 KiB
            per block (`default_block_rows`).

    Returns:
        The normalized array, of the shape and dtype of `x`, living in the
        buffer that held `x`.
    """
    check_norm_args("layer_norm_", x, weight=weight, bias=bias)
    return _layer_norm_jit(
        x, weight, bias, eps=eps, block_rows=_check_block_rows(block_rows, x)
    )
