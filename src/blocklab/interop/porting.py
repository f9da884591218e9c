"""Port weights between blocklab modules and PyTorch-style state dicts.

blocklab's modules name their arrays as a PyTorch model written with the same
attribute names would (`attention.W_q`, `ffn.W_g`, `norm1`, ...), in PyTorch's
`(out, in)` weight layout, so the `state_dict` of such a PyTorch
`TransformerBlock` maps onto ours by name, array for array:

    sd = {k: v.detach().cpu().numpy() for k, v in torch_block.state_dict().items()}
    block = blocklab.load_state_dict(TransformerBlock(256, 8, key=key), sd)

A parameter's name is the dotted path of attribute names (and sequence
indices) from the module to the array, e.g. `attention.W_q.weight`. In a
`Stack` the per-block arrays are stored stacked; they are named per block,
`blocks.0.norm1.weight`, `blocks.1.norm1.weight`, ..., as a PyTorch
`nn.ModuleList` names them; a PyTorch `CharLM` with its blocks in `blks`
ports into `CharLM` after renaming the prefix `blks.` to `stack.blocks.`.

PyTorch's norms use other epsilons (`nn.LayerNorm`: 1e-5; `nn.RMSNorm()`: the
float32 machine epsilon) than blocklab's 1e-6, a relative output difference
of a few 1e-6 at unit-scale activations.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError
from ..nn.stack import Stack

__all__ = ["check_keys", "load_state_dict", "param_shapes", "state_dict"]


def _is_param(leaf) -> bool:
    """A floating-point array (concrete or abstract); ints and keys are not weights."""
    dtype = getattr(leaf, "dtype", None)
    return (
        hasattr(leaf, "shape")
        and dtype is not None
        and jnp.issubdtype(dtype, jnp.inexact)
    )


def _float_dtype(owner: str, dtype: Any, keeps: str) -> np.dtype | None:
    """`dtype` as a dtype if it is a floating one (`None` stays `None`: keep
    `keeps`), else a `ConfigError` naming it."""
    if dtype is None:
        return None
    try:
        out = jnp.dtype(dtype)
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise ConfigError(
            f"{owner}: dtype must be a floating-point dtype (e.g. jnp.float32, "
            f"jnp.bfloat16, jnp.float16) or None to keep {keeps}, got {dtype!r}."
        )
    return out


def _as_numpy(name: str, value: Any) -> np.ndarray:
    """A state-dict entry (NumPy, JAX, or a CPU PyTorch tensor) as a NumPy array."""
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch.Tensor
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            return np.asarray(value.float().numpy()).astype(jnp.bfloat16)
        value = value.numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"load_state_dict: key {name!r} is not an array ({type(value).__name__}:"
            f" {err})."
        ) from None


def _key_name(entry) -> str:
    for attr in ("name", "idx", "key"):
        if hasattr(entry, attr):
            return str(getattr(entry, attr))
    return str(entry)


class _BlockNames(list):
    """The per-block names of one stacked array; `head` names its `Stack`."""

    head: str = ""


def _walk(module, fn, prefix: str = ""):
    """Rebuild `module` with each parameter replaced by `fn(names, leaf)`.

    `names` is the dotted name of an ordinary parameter, or, for an array
    stacked along a `Stack`'s block axis, the list of its per-block names
    (`<stack>.blocks.<i>.<rest>`). Every other leaf is kept.
    """

    def visit(path, leaf):
        name = prefix + ".".join(_key_name(e) for e in path)
        if isinstance(leaf, Stack):
            head = f"{name}.blocks." if name else "blocks."

            def per_block(sub_name, sub_leaf):
                names = _BlockNames(
                    f"{head}{i}.{sub_name}" for i in range(leaf.num_blks)
                )
                names.head = head
                return fn(names, sub_leaf)

            return eqx.tree_at(lambda s: s.blocks, leaf, _walk(leaf.blocks, per_block))
        return fn(name, leaf) if _is_param(leaf) else leaf

    return jax.tree_util.tree_map_with_path(
        visit, module, is_leaf=lambda n: isinstance(n, Stack)
    )


def param_shapes(module) -> dict[str, tuple[int, ...]]:
    """`{dotted name: shape}` of every parameter of `module` (concrete or
    abstract), per block inside a `Stack`: the names of `state_dict`."""
    shapes = {}

    def record(names, leaf):
        if isinstance(names, str):
            shapes[names] = tuple(leaf.shape)
        else:
            shapes.update((n, tuple(leaf.shape[1:])) for n in names)
        return leaf

    _walk(module, record)
    return shapes


def state_dict(module) -> dict[str, np.ndarray]:
    """Every floating-point array of `module` as `{dotted name: numpy array}`.

    The inverse of `load_state_dict`: names and shapes are those a PyTorch
    model with the same attribute names would use, weights `(out, in)`.
    For a `Stack`, block i's arrays appear under `blocks.<i>.`.
    """
    # Ordinary arrays in tree order; a Stack's arrays block by block, as a
    # PyTorch ModuleList lists them (blocks.0.*, then blocks.1.*, ...).
    entries: list = []
    stacks: dict[str, list[list]] = {}

    def record(names, leaf):
        value = np.asarray(leaf)
        if isinstance(names, str):
            entries.append([(names, value)])
        else:
            if names.head not in stacks:
                stacks[names.head] = [[] for _ in names]
                entries.extend(stacks[names.head])
            for i, n in enumerate(names):
                stacks[names.head][i].append((n, value[i]))
        return leaf

    _walk(module, record)
    return {name: value for group in entries for name, value in group}


def check_keys(
    owner: str, expected: Any, given: Any, model: str, *, hint: str = ""
) -> None:
    """Raise `ConfigError` naming every missing and every unexpected key.

    Args:
        owner: the public function, first in the message.
        expected: the keys `model` has.
        given: the keys of the state dict received.
        model: what the state dict should match, in words.
        hint: appended to the message.
    """
    missing = [k for k in expected if k not in given]
    unexpected = [k for k in given if k not in expected]
    if missing or unexpected:
        problems = []
        if missing:
            problems.append(f"missing keys {missing}")
        if unexpected:
            problems.append(f"unexpected keys {unexpected}")
        raise ConfigError(
            f"{owner}: the state dict does not match {model}: "
            f"{'; '.join(problems)}.{hint}"
        )


def _non_finite(value: np.ndarray) -> str | None:
    """`None` when every value of the floating array `value` is finite, else
    what is wrong with it, in the one rule every weight loader states
    (`load_state_dict`, `load_pretrained`): `"holds 2 non-finite value(s)
    (first: nan at index [0, 3]); refusing to load NaN or infinite weights"`.
    """
    flat = np.ravel(value)  # a view of a contiguous array
    step = 1 << 22  # bounds the temporary mask of a large tensor
    if all(np.isfinite(flat[i : i + step]).all() for i in range(0, flat.size, step)):
        return None
    bad = ~np.isfinite(value)
    where = tuple(int(i) for i in np.argwhere(bad)[0])
    return (
        f"holds {int(bad.sum())} non-finite value(s) (first: {float(value[where])} at "
        f"index {list(where)}); refusing to load NaN or infinite weights"
    )


def _converted(
    piece: np.ndarray,
    dtype: Any,
    name: str,
    *,
    what: str = "tensor",
    hint: str = " (or None, the stored dtypes)",
) -> np.ndarray:
    """`piece` cast to `dtype` (itself when it has it already), refused when
    the cast overflows to infinity (as `load_state_dict` refuses it); the
    error names the `what` `name` and ends with `hint` after "pass a wider
    dtype=" (`load_pretrained`'s message)."""
    piece = np.asarray(piece)
    if piece.dtype == dtype:
        return piece
    with np.errstate(over="ignore", invalid="ignore"):
        out = piece.astype(dtype)
    if _non_finite(out) is not None:
        raise ConfigError(
            f"load_pretrained: {what} {name!r} overflows dtype="
            f"{np.dtype(dtype).name} (its largest magnitude is "
            f"{float(np.abs(piece).max())!r}); pass a wider dtype={hint}."
        )
    return out


def _put(array: np.ndarray, sharding: Any) -> jax.Array:
    """`array` on the devices of `sharding` (`None`: the default device)."""
    if sharding is not None:
        return jax.device_put(array, sharding)
    return jnp.asarray(array)


def load_state_dict(module, state_dict: Mapping[str, Any], *, dtype=None):
    """Return a copy of `module` with every parameter taken from `state_dict`.

    Args:
        module: any blocklab module (concrete, or abstract from
            `eqx.filter_eval_shape`, which allocates nothing).
        state_dict: `{dotted name: array}`, e.g. a PyTorch `state_dict` with
            its tensors converted by `.numpy()`. Keys must match the names of
            `blocklab.state_dict(module)` exactly.
        dtype: cast every array to this dtype; `None` keeps the dtype each
            parameter has in `module` (float32 by default).

    Returns:
        A new module of the same structure; `module` is unchanged.

    Raises:
        ConfigError: naming every missing key and every unexpected key, a
            key whose array has the wrong shape (with both shapes), or a key
            whose array is not real floating point (integer, bool and complex
            arrays are refused rather than cast) or holds NaN or infinities.
    """
    expected = param_shapes(module)
    check_keys(
        "load_state_dict",
        expected,
        state_dict,
        f"the {type(module).__name__}",
        hint=f" The module's keys are {list(expected)}.",
    )
    dtype = _float_dtype("load_state_dict", dtype, "each parameter's dtype")
    arrays = {}
    for name, shape in expected.items():
        value = _as_numpy(name, state_dict[name])
        got = tuple(value.shape)
        if got != shape:
            raise ConfigError(
                f"load_state_dict: shape mismatch for key {name!r}: the state "
                f"dict has shape {got}, the module expects shape {shape} "
                "(weights are (out_features, in_features), as in PyTorch)."
            )
        if not jnp.issubdtype(value.dtype, jnp.floating):
            raise ConfigError(
                f"load_state_dict: key {name!r} holds an array of dtype "
                f"{value.dtype}; parameters must be real floating point (an "
                "integer, bool or complex array is refused, not cast). Convert "
                "it with .astype(np.float32) if that is what you mean."
            )
        bad = _non_finite(value)
        if bad is not None:
            raise ConfigError(f"load_state_dict: key {name!r} {bad}.")
        arrays[name] = value

    def cast(name, target):
        with np.errstate(over="ignore"):  # an overflow is reported just below
            out = jnp.asarray(arrays[name], target)
        if not bool(jnp.all(jnp.isfinite(out))):
            raise ConfigError(
                f"load_state_dict: key {name!r} overflows {jnp.dtype(target)} "
                f"(its largest magnitude is {np.abs(arrays[name]).max()!r}); "
                "pass a wider dtype= or rescale the weights."
            )
        return out

    def take(names, leaf):
        target = leaf.dtype if dtype is None else dtype
        if isinstance(names, str):
            return cast(names, target)
        return jnp.stack([cast(n, target) for n in names])

    return _walk(module, take)
