r"""Batch sources: pure ones traced into the compiled step, host ones drawn every step.

Training draws one batch per step. There are two kinds of source, and they
run in different places:

- A **pure source** is a function of the step's key, `source(key) -> batch`
  (or an object with `source.batch(key)`, e.g. `LMBatches` of a token
  dataset). It is *traced once* into the compiled step: the batch is
  computed on the device from the key, so it must be a JAX function of the
  key (`jax.random`, indexing arrays it holds). It composes with `jax.vmap`
  (sweeps) and fused steps (`lax.scan`).
- A **host source** runs Python on the host every step: an iterator or
  generator (reading files, a data loader), any other iterable of batches
  (a list, a `torch.utils.data.DataLoader`), or a host callable wrapped as
  `host_source(fn)`, called as `fn(key)` with the step's concrete key. Step
  $s$ trains on the $s$-th batch drawn. The batches of a chunk of fused
  steps are drawn, stacked and put on the device while the previous chunk
  runs (prefetch). When an iterator runs out, training ends there with a
  message, and the finished steps are kept.

Telling them apart: iterators and non-callable iterables are host sources;
`host_source(...)` marks one explicitly. A plain callable is taken as a pure
source, but it is traced twice first (`check_pure`): a callable with side
effects (`lambda key: next(it)`, a NumPy random generator) gives different
constants in the two traces, and would give the same batch at every step,
so it is refused with the forms that work. A callable that ignores its key
and returns the same arrays (a fixed batch) is pure and accepted.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import jax
import numpy as np

from .._validate import ConfigError

__all__ = ["HostSource", "check_pure", "host_source", "is_host_source"]

FORMS = (
    "a pure source source(key) -> batch (a JAX function of the key, traced into "
    "the compiled step), an object with source.batch(key), a token dataset, or a "
    "host source: an iterator, generator or iterable of batches, or "
    "blocklab.host_source(fn) for a host callable fn(key) called every step"
)


class HostSource:
    """Batches drawn on the host, one per step (see the module docstring).

    Build it with `host_source(obj)`. `obj` is an iterable or iterator of
    batches (pytrees of arrays of one structure, shapes and dtypes), or a
    callable `fn(key) -> batch` run on the host with each step's key.
    """

    def __init__(self, obj: Any, *, _owner: str = "host_source"):
        if isinstance(obj, HostSource):
            obj = obj._obj
        self._obj = obj
        self._fn: Callable[[Any], Any] | None = None
        self._it: Iterator[Any] | None = None
        if _is_iterable_source(obj):
            self._it = iter(obj)
        elif callable(obj):
            self._fn = obj
        else:
            raise ConfigError(
                f"{_owner}: a host source is an iterable of batches or a callable "
                f"fn(key) -> batch, got {type(obj).__name__}."
            )
        self._peeked: list[Any] = []
        self._spec: Any = None
        self.drawn = 0

    def __repr__(self) -> str:
        return f"HostSource({type(self._obj).__name__})"

    def _next(self, key: Any) -> Any:
        if self._peeked:
            return self._peeked.pop(0)
        if self._fn is not None:
            return self._fn(key)
        return next(self._it)

    def peek(self, key: Any, *, _owner: str = "host_source") -> Any:
        """The next batch, kept for the next `take` (used to check shapes)."""
        owner = _owner
        if not self._peeked:
            try:
                batch = self._next(key)
            except StopIteration:
                raise ConfigError(
                    f"{owner}: the host source yielded no batch (an empty or "
                    "exhausted iterator)."
                ) from None
            self._peeked.append(self._checked(batch, owner=owner, index=0))
        return self._peeked[0]

    def _checked(self, batch: Any, *, owner: str, index: int) -> Any:
        leaves, tree = jax.tree_util.tree_flatten(batch)
        try:
            spec = (tree, [(np.shape(a), np.result_type(a)) for a in leaves])
        except TypeError as err:
            raise ConfigError(
                f"{owner}: host source batch {index} is not a pytree of arrays: {err}"
            ) from err
        if self._spec is None:
            self._spec = spec
        elif spec != self._spec:
            raise ConfigError(
                f"{owner}: host source batch {index} has structure/shapes {spec} "
                f"but the first batch had {self._spec}; every batch must have the "
                "same structure, shapes and dtypes."
            )
        return batch

    def take(self, keys: Any, *, _owner: str = "host_source") -> list[Any]:
        """Up to `len(keys)` batches; fewer if an iterator runs out."""
        owner = _owner
        out = []
        for i in range(len(keys)):
            try:
                batch = self._next(keys[i])
            except StopIteration:
                break
            out.append(self._checked(batch, owner=owner, index=self.drawn))
            self.drawn += 1
        return out


def host_source(obj: Any) -> HostSource:
    """Mark `obj` as a host source: drawn on the host once per step.

    Args:
        obj: an iterable or iterator of batches (a generator reading files, a
            data loader, a list), or a callable `fn(key) -> batch` that runs
            Python on the host (it gets each step's concrete PRNG key).

    `train_model(model, host_source(lambda key: next(it)), ...)` trains step
    $s$ on the $s$-th batch of `it` and ends when `it` runs out.
    """
    return HostSource(obj)


def _is_iterable_source(obj: Any) -> bool:
    """An iterator, or an iterable that is not an array, string or mapping."""
    if isinstance(obj, (str, bytes, dict, np.ndarray, np.generic)) or hasattr(
        obj, "__array__"
    ):
        return False
    if isinstance(obj, jax.Array):
        return False
    return isinstance(obj, (Iterator, Iterable)) or hasattr(obj, "__next__")


def is_host_source(obj: Any) -> bool:
    """Whether `obj` is drawn on the host (see the module docstring)."""
    if isinstance(obj, HostSource):
        return True
    if callable(obj) or callable(getattr(obj, "batch", None)):
        return False
    return _is_iterable_source(obj)


def _trace(draw: Callable[[Any], Any]) -> tuple[str, list[Any]]:
    # A fresh wrapper each time: make_jaxpr caches traces by function.
    closed = jax.make_jaxpr(lambda k: draw(k))(jax.random.key(0))
    return str(closed.jaxpr), list(closed.consts)


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    try:
        a, b = np.asarray(a), np.asarray(b)
    except Exception:  # noqa: BLE001 - e.g. typed keys: compare as data
        a, b = np.asarray(jax.random.key_data(a)), np.asarray(jax.random.key_data(b))
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b, True)


def check_pure(draw: Callable[[Any], Any], *, _owner: str = "check_pure") -> None:
    """Refuse a callable source with side effects (it would be frozen by tracing).

    The source is traced twice. A pure function of the key gives the same
    program and constants both times; one that reads an iterator or a host
    random generator gives different constants (the two batches it drew).

    Raises:
        ConfigError: the traces differ (the message names the supported forms).
    """
    owner = _owner
    try:
        first = _trace(draw)
        second = _trace(draw)
    except StopIteration as err:
        raise ConfigError(
            f"{owner}: the batch source raised StopIteration when traced: it reads "
            f"an iterator, so tracing would freeze it. Supported: {FORMS}."
        ) from err
    except Exception:  # noqa: BLE001 - TrainStep.check reports trace failures
        return
    same = first[0] == second[0] and len(first[1]) == len(second[1])
    same = same and all(
        _same(a, b) for a, b in itertools.zip_longest(first[1], second[1])
    )
    if not same:
        raise ConfigError(
            f"{owner}: the batch source returned different batches when traced "
            "twice with the same key: it has side effects (it reads an iterator "
            "or a host random generator), and traced into the compiled step it "
            "would train on one batch at every step. Wrap it as "
            "blocklab.host_source(source) to draw it on the host every "
            f"step, or make it a JAX function of the key. Supported: {FORMS}."
        )
