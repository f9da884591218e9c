r"""The member axis: one function mapped over K members, sharded over the devices.

Every multi-member experiment in blocklab (seed sweeps of the signal
diagnostics, the training sweeps of `blocklab.training.sweep`) lays its members along
a leading axis of size K and maps one per-member program over it.

The K axis is laid out over a 1-D `jax.sharding.Mesh` of all
visible devices (axis name `"members"`) with
`NamedSharding(mesh, PartitionSpec("members"))`; the corpus and the step
count are replicated. K is padded up to a multiple of the device count by
repeating the last member, and the padding is dropped from every result.
Members never communicate, so each device runs its own members and XLA
inserts no collectives. The same code runs on one CPU, a multi-GPU host or a
TPU slice (`member_mesh()` takes `jax.devices()`). To test many devices on a
CPU, set `XLA_FLAGS=--xla_force_host_platform_device_count=4` before JAX starts.

**Many hosts.** Call `blocklab.training.distributed.initialize()` (or
`jax.distributed.initialize()`) first on every process (coordinator address,
process count and id come from `blocklab launch` or the cluster environment:
SLURM, TPU pods, ...); `jax.devices()` then lists the
devices of *all* hosts and `member_mesh()` spans them. Every process runs the
same program with the same arguments; the member arrays are built with
`jax.make_array_from_callback`, so each process only materializes its own
members, and results are gathered with
`jax.experimental.multihost_utils.process_allgather`.
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from jaxtyping import Array, ArrayLike, Integer, Key, PRNGKeyArray, UInt32

from .._validate import ConfigError, check_int
from .placement import auto_mesh

__all__ = [
    "AXIS",
    "MAX_SEED",
    "MemberKeys",
    "check_seeds",
    "global_rows",
    "is_seeds",
    "key_data",
    "member_mesh",
    "member_sharding",
    "pad_members",
    "pad_rows",
    "sharded_map",
    "to_host",
    "wrap_key",
]

#: The name of the mesh axis that carries the members.
AXIS = "members"

#: Per-member keys: `(K,)` typed PRNG keys, `(K, 2)` raw uint32 keys, or K int seeds.
MemberKeys = (
    Key[Array, " K"] | UInt32[Array, "K _"] | Integer[np.ndarray, " K"] | Sequence[int]
)


def member_mesh(devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D mesh (axis `"members"`) over `devices` (default: every visible device).

    After `jax.distributed.initialize()`, `jax.devices()` is the devices of all
    hosts, so the default mesh spans the whole cluster.
    """
    devices = jax.devices() if devices is None else list(devices)
    if not devices:
        raise ConfigError(
            "member_mesh: devices must not be empty, got []; pass None for every "
            "visible device."
        )
    return Mesh(np.asarray(devices), (AXIS,))


def pad_members(num_members: int, num_devices: int) -> int:
    """The smallest multiple of `num_devices` that is >= `num_members`."""
    num_members = check_int("pad_members", "num_members", num_members, min=1)
    num_devices = check_int("pad_members", "num_devices", num_devices, min=1)
    return -(-num_members // num_devices) * num_devices


def pad_rows(x: np.ndarray, size: int) -> np.ndarray:
    """Pad axis 0 of `x` to `size` rows by repeating its last row (a host array)."""
    extra = size - x.shape[0]
    return x if extra == 0 else np.concatenate([x, np.repeat(x[-1:], extra, 0)])


def global_rows(x: ArrayLike, mesh: Mesh) -> Array:
    """A host array (padded to the mesh) as a global array sharded over its axis 0.

    Built with `jax.make_array_from_callback`: each process materializes only
    the rows of its own devices.
    """
    x = np.asarray(x)
    sharding = NamedSharding(mesh, PartitionSpec(AXIS))
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def to_host(x: Array) -> np.ndarray:
    """A (possibly multi-host) array as one NumPy array on this host."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(x)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


#: The largest seed: `jax.random.key(seed)` takes a uint32.
MAX_SEED = 2**32 - 1


def check_seeds(
    seeds: Any,
    *,
    name: str = "seeds",
    distinct: bool = True,
    _owner: str = "check_seeds",
) -> tuple[int, ...]:
    """One rule for seeds: a non-empty sequence of ints in `[0, 2**32 - 1]`.

    Python or NumPy integers (not `bool`); with `distinct=True` (lists of
    runs, e.g. a CLI's `--seeds`) no seed may repeat, since two equal seeds
    are the same run twice. Sweeps pass `distinct=False`: members may share a
    seed and differ in hyperparameters. Returns the seeds as Python ints.

    Raises:
        ConfigError: naming the caller, `name`, the offending entry and the rule.
    """
    owner = _owner
    if isinstance(seeds, (str, bytes)) or not isinstance(seeds, Iterable):
        raise ConfigError(
            f"{owner}: {name} must be a sequence of int seeds, got {seeds!r}."
        )
    out = tuple(
        check_int(owner, f"{name}[{i}]", s, min=0, max=MAX_SEED)
        for i, s in enumerate(seeds)
    )
    if not out:
        raise ConfigError(f"{owner}: {name} must hold at least one seed, got none.")
    if distinct:
        dup = sorted({s for s in out if out.count(s) > 1})
        if dup:
            raise ConfigError(
                f"{owner}: {name} must be distinct, got {list(out)} (repeated: "
                f"{dup}); each seed is one run."
            )
    return out


def is_seeds(keys: Any) -> bool:
    """A list/tuple/range of integers, or a 1-D integer NumPy array."""
    if isinstance(keys, np.ndarray):
        return keys.ndim == 1 and np.issubdtype(keys.dtype, np.integer)
    return isinstance(keys, (list, tuple, range)) and all(
        isinstance(s, numbers.Integral) for s in keys
    )


def key_data(
    keys: MemberKeys, name: str = "keys", *, _owner: str = "sharded_map"
) -> np.ndarray:
    """Raw key data `(K, ...)` of typed keys, legacy uint32 keys or int seeds."""
    owner = _owner
    if is_seeds(keys):
        seeds = check_seeds(keys, name=name, distinct=False, _owner=owner)
        keys = jax.vmap(jax.random.key)(jnp.asarray(seeds, jnp.uint32))
    keys = jnp.asarray(keys) if not isinstance(keys, jax.Array) else keys
    if jnp.issubdtype(keys.dtype, jax.dtypes.prng_key):
        return np.asarray(jax.random.key_data(keys))
    if keys.dtype != jnp.uint32 or keys.ndim != 2:
        raise ConfigError(
            f"{owner}: {name} must be int seeds (e.g. [0, 1, 2]) or PRNG keys "
            f"(jax.random.split(jax.random.key(0), K)), got an array of dtype "
            f"{keys.dtype} and shape {tuple(keys.shape)}"
            + (
                " (float seeds are refused, not truncated)"
                if jnp.issubdtype(keys.dtype, jnp.floating)
                else ""
            )
            + "."
        )
    return np.asarray(keys)


def wrap_key(data: Array) -> PRNGKeyArray:
    """A typed PRNG key of raw key data (one row of `key_data`)."""
    return jax.random.wrap_key_data(data)


def member_sharding(mesh: Mesh) -> NamedSharding:
    """Axis 0 split over the mesh axis `"members"`; the other axes replicated."""
    return NamedSharding(mesh, PartitionSpec(AXIS))


def sharded_map(
    fn: Callable[..., Any],
    keys: MemberKeys,
    *args: ArrayLike,
    mesh: Mesh | None = None,
    chunk: int | None = None,
) -> Any:
    """`jax.vmap(fn)(keys, *args)` as one jitted program sharded over the devices.

    The leading (member) axis of `keys` and of every array in `args` is
    padded to a multiple of the device count, laid out over `mesh`
    (`member_mesh()` by default), mapped, and the padding dropped. Used for
    the seed axis of `blocklab.diagnostics.propagation` experiments.

    With `chunk`, the members run `chunk` at a time (rounded up to a multiple
    of the device count): memory then grows with `chunk`, not K, and every
    call has the same shape, so the program still compiles once (the last
    chunk is padded). Member k's values do not depend on the chunking.

    Args:
        fn: `fn(key, *row)` for one member; returns a pytree of arrays.
        keys: `(K,)` PRNG keys or a sequence of int seeds (seed s is
            `jax.random.key(s)`).
        *args: arrays with leading axis K (e.g. per-member hyperparameters).
        mesh: a 1-D mesh with axis `"members"` (`Auto` or `Explicit`: the
            program runs on its `Auto` view, `placement.auto_mesh`).
        chunk: members per compiled call (>= 1); `None`: all K at once.

    Returns:
        `fn`'s pytree with a leading axis K on every leaf (gathered onto the
        default device; the padding dropped).
    """
    # fn is written for propagation, as every blocklab program: on an
    # Explicit axis its values' layouts would be part of their types.
    mesh = auto_mesh(member_mesh() if mesh is None else mesh)
    check_int("sharded_map", "chunk", chunk, min=1, optional=True)
    data = key_data(keys)
    K = data.shape[0]
    for i, a in enumerate(args):
        if np.shape(a)[:1] != (K,):
            raise ConfigError(
                f"sharded_map: args[{i}] must have leading axis K={K}, got shape "
                f"{np.shape(a)}."
            )
    rows = [np.asarray(a) for a in (data, *args)]
    step = pad_members(min(K, chunk or K), mesh.devices.size)
    program = _mapped(fn, member_sharding(mesh))
    parts = []
    for start in range(0, K, step):
        inputs = [
            global_rows(pad_rows(r[start : start + step], step), mesh) for r in rows
        ]
        parts.append(jax.tree_util.tree_map(to_host, program(*inputs)))
    return jax.tree_util.tree_map(lambda *p: jnp.asarray(np.concatenate(p)[:K]), *parts)


@functools.lru_cache(maxsize=64)
def _mapped(fn, sharding):
    # Cached on (fn, sharding): calling again with the same function reuses
    # the compiled program.
    def run(data, *args):
        out = jax.vmap(lambda k, *a: fn(wrap_key(k), *a))(data, *args)
        return jax.lax.with_sharding_constraint(out, sharding)

    return jax.jit(run)
