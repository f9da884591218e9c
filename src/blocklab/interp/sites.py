r"""Site names: the catalogue of a model's activation sites, and the
resolution of names and patterns into what a forward pass records and edits.

A model reports its sites through `blocklab.nn.hooks.Hooks` under
TransformerLens's names. Sites of a scanned stack are reported once for all
blocks as `blocks.*.<site>` with a leading layer axis; their concrete names
are `blocks.0.<site>`, ..., `blocks.{L-1}.<site>`. A name or pattern
(`fnmatch`: `*` matches any characters, dots included; `[0-3]` a range)
selects concrete names. Values come back

- under the site's own name for a site outside the stack (`hook_embed`,
  `ln_final.hook_normalized`, `unembed.hook_out`);
- as `blocks.*.<site>`, stacked `(L, ...)`, when every layer of a stacked
  site is selected;
- as `blocks.{l}.<site>`, one entry per layer, when only some are.
"""

from __future__ import annotations

import difflib
import fnmatch
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._validate import ConfigError
from ..nn.hooks import STACKED, Edit, Hooks

__all__ = [
    "site_shapes",
    "site_names",
    "Selection",
    "select",
    "call_with_hooks",
    "unpack",
]

#: site -> `None` (all of it) or the sorted tuple of selected layers.
Selection = dict[str, "tuple[int, ...] | None"]

#: Catalogues by model structure and input shapes, the most recent last.
_CATALOGUES: OrderedDict[Any, dict[str, jax.ShapeDtypeStruct]] = OrderedDict()
_CATALOGUES_KEPT = 64


def call_with_hooks(model: Any, inputs: Any, hooks: Hooks | None, kwargs) -> Any:
    """`model(inputs, hooks=hooks, **kwargs)`, with a clear error for a model
    whose `__call__` has no `hooks` argument."""
    if hooks is None:
        return model(inputs, **kwargs)
    try:
        return model(inputs, hooks=hooks, **kwargs)
    except TypeError as err:
        if "hooks" not in str(err):
            raise
        raise ConfigError(
            f"model of type {type(model).__name__} has no activation sites (its "
            "__call__ takes no `hooks`); pass a DecoderLM, CharLM, EncoderModel, "
            "EncoderDecoderLM (its decoder's sites; encode(..., hooks=) has the "
            "encoder's), Stack, TransformerBlock, MultiHeadAttention or FeedForward."
        ) from err


def _cache_key(model, inputs, kwargs):
    leaves, treedef = jax.tree_util.tree_flatten((model, inputs, kwargs))
    sig = tuple(
        (tuple(x.shape), str(x.dtype)) if hasattr(x, "shape") else repr(x)
        for x in leaves
    )
    return treedef, sig


def site_shapes(
    model: Any, inputs: Any, **kwargs: Any
) -> dict[str, jax.ShapeDtypeStruct]:
    """Every activation site of `model` on `inputs`, with its shape and dtype.

    Computed by `jax.eval_shape` (nothing runs) and cached per model
    structure and input shapes. Stacked sites are keyed `blocks.*.<site>`
    with their leading layer axis. `kwargs` are forwarded to the model's
    call (`positions`, a decoder's `segment_ids`, a layer's `mask`; an
    encoder–decoder's `tgt_ids` and `src_mask`, a cross-attention stack's `context`: the
    cross-attention sites `blocks.*.ln_cross.*`, `blocks.*.cross_attn.*`,
    `blocks.*.hook_cross_attn_out`, `blocks.*.hook_resid_mid_cross` come
    with them).
    """
    key = _cache_key(model, inputs, kwargs)
    try:
        hit = _CATALOGUES.get(key)
    except TypeError:  # an unhashable static field: no caching
        key, hit = None, None
    if hit is not None:
        _CATALOGUES.move_to_end(key)
        return hit

    def run(m, x, kw):
        hooks = Hooks("all")
        call_with_hooks(m, x, hooks, kw)
        return hooks.values

    shapes = jax.eval_shape(run, model, inputs, kwargs)
    if key is not None:
        _CATALOGUES[key] = shapes
        while len(_CATALOGUES) > _CATALOGUES_KEPT:
            _CATALOGUES.popitem(last=False)
    return shapes


def _concrete(catalogue: Mapping[str, Any]) -> dict[str, tuple[str, int | None]]:
    """concrete name -> (site, layer or None)."""
    out: dict[str, tuple[str, int | None]] = {}
    for site, spec in catalogue.items():
        if site.startswith(STACKED):
            rest = site[len(STACKED) :]
            for layer in range(spec.shape[0]):
                out[f"blocks.{layer}.{rest}"] = (site, layer)
        else:
            out[site] = (site, None)
    return out


def site_names(model: Any, inputs: Any, **kwargs: Any) -> list[str]:
    """The concrete site names of `model` on `inputs` (`blocks.3.hook_q`, ...)."""
    return list(_concrete(site_shapes(model, inputs, **kwargs)))


def select(
    catalogue: Mapping[str, Any], patterns: str | Sequence[str], *, what: str = "sites"
) -> Selection:
    """Resolve names and patterns against a catalogue (`site_shapes`).

    Every pattern must match at least one concrete site; one that does not is
    refused with the closest names. Returns site -> `None` (every layer, or a
    site outside the stack) or the selected layers.
    """
    if isinstance(patterns, str):
        patterns = [patterns]
    elif not isinstance(patterns, (list, tuple)):
        raise ConfigError(
            f"{what} must be a site name or pattern (a str) or a list of them, "
            f"e.g. 'blocks.*.hook_resid_post', got {type(patterns).__name__} "
            f"{patterns!r}."
        )
    concrete = _concrete(catalogue)
    chosen: dict[str, set[int | None]] = {}
    for pattern in patterns:
        if not isinstance(pattern, str):
            raise ConfigError(
                f"{what}: each entry must be a site name or pattern (a str), got "
                f"{type(pattern).__name__} {pattern!r}."
            )
        if pattern in catalogue:  # the stacked form itself: every layer
            hits = [n for n, (s, _) in concrete.items() if s == pattern]
        else:
            hits = fnmatch.filter(concrete, pattern)
        if not hits:
            close = difflib.get_close_matches(pattern, list(concrete), n=3, cutoff=0.5)
            stacked = sorted({s for s in catalogue if s.startswith(STACKED)})
            others = sorted(s for s in catalogue if not s.startswith(STACKED))
            hint = f" Did you mean {close}?" if close else ""
            raise ConfigError(
                f"{what}: {pattern!r} matches no activation site of this model."
                f"{hint} Sites: {others + stacked} (stacked ones also as "
                "blocks.<layer>.<site>)."
            )
        for name in hits:
            site, layer = concrete[name]
            chosen.setdefault(site, set()).add(layer)
    out: Selection = {}
    for site, layers in chosen.items():
        if None in layers:
            out[site] = None
        else:
            total = catalogue[site].shape[0]
            got = tuple(sorted(layers))  # type: ignore[arg-type]
            out[site] = None if len(got) == total else got
    return out


def unpack(
    values: Mapping[str, Any],
    selection: Selection,
    *,
    model: Any = None,
    layer_axis: int = 0,
) -> dict[str, Any]:
    """The recorded values under the names the module docstring gives; a
    selected site the call never reached is refused by name. `layer_axis`:
    where a stacked site's layer axis is (1 behind a leading step axis)."""
    missing = sorted(set(selection) - set(values))
    if missing:
        raise ConfigError(
            f"site(s) {missing} were not reached by this call of "
            f"{type(model).__name__} (its path has no such point)."
        )
    out: dict[str, Any] = {}
    for site, layers in selection.items():
        value = values[site]
        if layers is None:
            out[site] = value
        else:
            rest = site[len(STACKED) :]
            for layer in layers:
                out[f"blocks.{layer}.{rest}"] = jnp.take(value, layer, axis=layer_axis)
    return out


def edit_table(
    catalogue: Mapping[str, Any], edits: Mapping[str, Edit]
) -> dict[str, list[tuple[Edit, tuple[int, ...] | None]]]:
    """`Hooks`' edit table from a mapping of names or patterns to
    `fn(value, layer)`."""
    if not isinstance(edits, Mapping):
        raise ConfigError(
            f"edits must map site names or patterns to fn(value, layer), got "
            f"{type(edits).__name__}."
        )
    table: dict[str, list[tuple[Edit, tuple[int, ...] | None]]] = {}
    for pattern, fn in edits.items():
        if not callable(fn):
            raise ConfigError(
                f"edits[{pattern!r}] must be a function fn(value, layer) -> value, "
                f"got {type(fn).__name__}."
            )
        for site, layers in select(catalogue, pattern, what="edits").items():
            table.setdefault(site, []).append((fn, layers))
    return table
