"""Argument checks shared by every public constructor and function.

One mechanism instead of per-call patches: each check names the owner (the
class or function), the argument, the value received and what is valid, and
raises `ValueError` (or `TypeError` for a wrong type). They run on Python
values at construction or call time, never on traced arrays: value checks on
arrays inside `jit` use `eqx.error_if`.

The rules:

- a flag is a Python `bool` (or `numpy.bool_`); `"no"`, `0` and `None` are not;
- a count is an integer (Python or NumPy) that is not a `bool`;
- a real number is an `int`/`float` or NumPy scalar (not `bool`) and finite;
- NumPy integer and float scalars are accepted wherever a Python number is,
  and are returned as Python numbers (so they can be static fields and pass
  through `jit` as static configuration).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

__all__ = [
    "ConfigError",
    "check_bool",
    "check_int",
    "check_float",
    "check_choice",
    "check_ids",
    "check_key",
]


class ConfigError(ValueError, TypeError):
    """A bad argument: both a `ValueError` and a `TypeError`, so callers may
    catch either (a wrong type and a wrong value are reported the same way)."""


def check_bool(owner: str, name: str, value: Any) -> bool:
    """Return `value` as a `bool`; refuse anything that is not a boolean."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ConfigError(
        f"{owner}: {name} must be a bool (True or False), got {value!r} "
        f"of type {type(value).__name__}."
    )


def check_int(
    owner: str,
    name: str,
    value: Any,
    *,
    min: int | None = None,  # noqa: A002 - reads best at the call site
    max: int | None = None,  # noqa: A002
    optional: bool = False,
) -> int | None:
    """Return `value` as a Python `int` in `[min, max]`.

    Booleans are refused (`True` is not a head count); NumPy integers are
    accepted. With `optional=True`, `None` passes through.
    """
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise ConfigError(
            f"{owner}: {name} must be an int, got {value!r} of type "
            f"{type(value).__name__}."
        )
    value = int(value)
    if (min is not None and value < min) or (max is not None and value > max):
        lo = "-inf" if min is None else str(min)
        hi = "inf" if max is None else str(max)
        raise ConfigError(f"{owner}: {name} must lie in [{lo}, {hi}], got {value}.")
    return value


def check_float(
    owner: str,
    name: str,
    value: Any,
    *,
    min: float | None = None,  # noqa: A002
    max: float | None = None,  # noqa: A002
    min_open: bool = False,
    max_open: bool = False,
    optional: bool = False,
) -> float | None:
    """Return `value` as a finite Python `float` in the given interval.

    `min_open` / `max_open` make that end of the interval strict (`> 0`
    rather than `>= 0`). NaN and infinities are refused; booleans are refused.
    With `optional=True`, `None` passes through.
    """
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise ConfigError(
            f"{owner}: {name} must be a real number, got {value!r} of type "
            f"{type(value).__name__}."
        )
    value = float(value)
    if not math.isfinite(value):
        raise ConfigError(f"{owner}: {name} must be finite, got {value}.")
    below = min is not None and (value <= min if min_open else value < min)
    above = max is not None and (value >= max if max_open else value > max)
    if below or above:
        lo = "-inf" if min is None else repr(float(min))
        hi = "inf" if max is None else repr(float(max))
        interval = f"{'(' if min_open else '['}{lo}, {hi}{')' if max_open else ']'}"
        raise ConfigError(f"{owner}: {name} must lie in {interval}, got {value}.")
    return value


def check_choice(owner: str, name: str, value: Any, choices: Iterable[Any]) -> Any:
    """Return `value` if it is one of `choices` (compared by equality and type)."""
    choices = tuple(choices)
    for choice in choices:
        if type(value) is type(choice) and value == choice:
            return value
    raise ConfigError(
        f"{owner}: {name} must be one of {list(choices)}, got {name}={value!r}."
    )


def check_key(owner: str, name: str, key: Any) -> Any:
    """Refuse a missing or non-key `key` argument with a message naming the fix.

    Accepts typed keys (`jax.random.key`) and legacy uint32 `(2,)` keys
    (`jax.random.PRNGKey`); tracers pass (their shape and dtype are checked).
    """
    import jax
    import jax.numpy as jnp

    fix = f"pass {name}=jax.random.key(0) (or a subkey from jax.random.split)"
    if key is None:
        raise ConfigError(f"{owner}: {name} is required; {fix}.")
    if isinstance(key, (numbers.Number, np.generic)) or not hasattr(key, "dtype"):
        raise ConfigError(
            f"{owner}: {name} must be a JAX PRNG key, got {key!r} of type "
            f"{type(key).__name__}; {fix}."
        )
    if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        return key
    if key.dtype == jnp.uint32 and key.shape[-1:] == (2,):
        return key
    raise ConfigError(
        f"{owner}: {name} must be a JAX PRNG key, got an array of dtype "
        f"{key.dtype} and shape {tuple(key.shape)}; {fix}."
    )


class _IdMessages(Sequence):
    """`check_ids`' message table for `eqx.branched_error_if`, indexed by the id.

    Entry `i` is the message for offending id `i` (any integer), so the traced
    check names the id the way the concrete one does. Hashable (a static
    argument of `eqx.filter_jit`).
    """

    def __init__(self, owner: str, name: str, valid: str):
        self._key = (owner, name, valid)

    def __getitem__(self, i: Any) -> str:
        owner, name, valid = self._key
        return (
            f"{owner}: {name} must lie in {valid}, got {int(i)} (the "
            f"{'smallest' if int(i) < 0 else 'largest'} id of the batch; check "
            "the ids' encoding)."
        )

    def __len__(self) -> int:  # every integer is an entry
        return 2**31

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _IdMessages) and self._key == other._key

    def __hash__(self) -> int:
        return hash(self._key)


def _error_if_on_every_device(value: Any, pred: Any, msgs: Sequence[str]) -> Any:
    """`eqx.branched_error_if(value, pred, value, msgs)` on scalars, mesh-safe.

    Under a context mesh (`jax.set_mesh`, as `train_model(mesh=)` sets) the
    check runs in a `shard_map` over every mesh axis, so the error callback
    runs, and raises, on every device at once. Outside one (a plain `jit`
    over sharded arrays), GSPMD pins the callback to device 0 and broadcasts
    its result: when it raises, the other devices wait in that broadcast
    until the runtime aborts the process; run such steps under `jax.set_mesh`.
    """
    import equinox as eqx
    import jax
    from jax.sharding import PartitionSpec

    def check(v, p):
        return eqx.branched_error_if(v, p, v, msgs)

    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:  # no mesh, or already per device
        return check(value, pred)
    return jax.shard_map(
        check,
        mesh=mesh,
        in_specs=(PartitionSpec(), PartitionSpec()),
        out_specs=PartitionSpec(),
        check_vma=False,
    )(value, pred)


def check_ids(
    owner: str, name: str, ids: Any, size: int, *, what: str = "vocab"
) -> Any:
    r"""Refuse integer ids outside `[0, size)`; returns `ids` (to thread through jit).

    Concrete ids (NumPy, or JAX arrays outside a trace) are checked in NumPy
    and raise `ConfigError` naming the first bad position, its value and
    `size`. Traced ids are reduced to two scalars, $h = \max_i \mathrm{ids}_i$
    and $l = \min_i \mathrm{ids}_i$ (over vmapped axes too), and the error is
    raised when $l < 0$ or $h \ge$ `size`, naming the argument, `size` and the
    offending id ($h$ if it is too large, else $l$): under `eqx.filter_jit`
    as an `EquinoxRuntimeError`, under `jax.jit` inside JAX's callback error.
    Non-integer ids are refused.

    On a mesh (ids split over devices) the check costs two scalar
    all-reduces: only the replicated scalars $v$ (the id to name) and the
    predicate reach the error branch, and the ids come back as
    `ids + (v' - v)`, $v'$ that branch's output (an elementwise add on each
    shard, so the check is not dead code). Under a context mesh
    (`jax.set_mesh`, which `train_model(mesh=)` and `train_sweep` set) the
    branch runs in a `shard_map` and raises on every device. Threading the
    ids themselves through the branch (plain `eqx.error_if(ids, ...)`) made
    GSPMD pin the whole `(B, T)` batch to device 0 in it (replicated by an
    all-reduce, re-split, XLA's "involuntary full rematerialization"), and
    an error raised on device 0 alone left the others waiting in that
    all-reduce until the runtime aborted the process.
    """
    import jax
    import jax.numpy as jnp

    dtype = getattr(ids, "dtype", None)
    if dtype is None:
        ids = np.asarray(ids)
        dtype = ids.dtype
    if not jnp.issubdtype(dtype, jnp.integer):
        raise ConfigError(
            f"{owner}: {name} must be integer ids, got dtype {dtype}; cast with "
            ".astype(jnp.int32)."
        )
    valid = f"[0, {what}={size})"
    if isinstance(ids, jax.core.Tracer):
        from equinox.internal import unvmap_max

        # ~x reverses the order without overflow: min = ~max(~x).
        hi = unvmap_max(jnp.max(ids))
        lo = ~unvmap_max(~jnp.min(ids))
        value = jnp.where(hi >= size, hi, lo)
        checked = _error_if_on_every_device(
            value, (lo < 0) | (hi >= size), _IdMessages(owner, name, valid)
        )
        return ids + (checked - value).astype(ids.dtype)
    arr = np.asarray(ids)
    bad = (arr < 0) | (arr >= size)
    if bad.any():
        where = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ConfigError(
            f"{owner}: {name} must lie in {valid}, got {int(arr[where])} at index "
            f"{list(where)}."
        )
    return ids
