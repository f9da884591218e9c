r"""Reading and editing a model's activations while it runs: `capture`,
`intervene`, and the gradient of a metric at the sites, `attribute`.

Each is a pure function of the model and its inputs: it runs the model's
ordinary forward pass with a `blocklab.nn.hooks.Hooks` built from the names
asked for (`blocklab.interp.sites` resolves names and patterns), so it
composes with `jax.jit`, `jax.vmap` (over prompts, seeds or a sweep's
members), `jax.grad` and sharded inputs, and a scanned stack stays one scan.
With no sites and no edits the model runs without hooks: the same program
as calling it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from .._validate import ConfigError
from ..nn.hooks import STACKED, Edit, Hooks
from .sites import call_with_hooks, edit_table, select, site_shapes, unpack

__all__ = ["capture", "intervene", "attribute"]


def capture(
    model: Any,
    inputs: Any,
    sites: str | Sequence[str],
    *,
    edits: Mapping[str, Edit] | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any]]:
    """Run `model(inputs, **kwargs)` and return its outputs with the values at `sites`.

    Args:
        model: a `DecoderLM`, `CharLM`, `Stack` or `TransformerBlock` (any
            module whose call takes `hooks`).
        inputs: what the model takes (token ids, or a stream `(T, d)`), one
            sequence or a batch.
        sites: names or patterns (`"blocks.*.hook_resid_post"`,
            `"blocks.3.attn.hook_pattern"`, `"*hook_z"`); see
            `blocklab.interp.sites` for the names and how values are keyed.
            Each must match a site (`ConfigError` names it otherwise).
        edits: as for `intervene`, applied in the same call; the values
            recorded are the edited ones.
        **kwargs: forwarded to the model's call (`positions`,
            `segment_ids`, `key`).

    Returns:
        `(outputs, values)`: the model's outputs, and a dict from name to
        value; a site of the scanned stack selected at every layer comes
        back stacked, `(L, ...)`.
    """
    catalogue = site_shapes(model, inputs, **kwargs)
    selection = select(catalogue, sites, what="sites")
    table = {} if not edits else edit_table(catalogue, edits)
    hooks = Hooks(set(selection), table)
    outputs = call_with_hooks(model, inputs, hooks, kwargs)
    return outputs, unpack(hooks.values, selection, model=model)


def intervene(
    model: Any,
    inputs: Any,
    edits: Mapping[str, Edit],
    **kwargs: Any,
) -> Any:
    """Run `model(inputs, **kwargs)` with the activations at some sites replaced.

    Args:
        model, inputs, kwargs: as for `capture`.
        edits: site name or pattern -> `fn(value, layer) -> value`. At each
            matching site the forward pass continues with `fn`'s value, which
            must keep the site's shape and dtype. `layer` is the block index
            (a traced int32 scalar) for a site of the scanned stack, `None`
            elsewhere; a pattern that selects some layers only edits those
            (`jnp.where` on `layer` inside the one scan). Several edits of one
            site apply in order. `blocklab.interp.edits` builds the usual
            ones (patching, ablation, steering).

    Returns:
        The model's outputs.
    """
    if not edits:
        return model(inputs, **kwargs)
    catalogue = site_shapes(model, inputs, **kwargs)
    hooks = Hooks(None, edit_table(catalogue, edits))
    return call_with_hooks(model, inputs, hooks, kwargs)


def attribute(
    model: Any,
    inputs: Any,
    sites: str | Sequence[str],
    metric: Callable[[Any], Any],
    *,
    edits: Mapping[str, Edit] | None = None,
    **kwargs: Any,
) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    r"""A scalar metric of the outputs, the values at `sites`, and the metric's
    gradient with respect to those values: one forward and one backward pass.

    For a site value $a$ and the metric $m$, the gradient
    $g = \partial m / \partial a$ is what attribution patching uses: patching
    $a$ to $a'$ changes $m$ by $g \cdot (a' - a) + O(|a' - a|^2)$. It is taken
    by adding a zero $\delta$ at each site, $a \leftarrow a + \delta$, and
    differentiating in $\delta$ (the downstream effect of the site, through
    every later layer and position).

    Args:
        model, inputs, sites, kwargs: as for `capture`.
        metric: `metric(outputs) -> ()` float.
        edits: as for `intervene`, applied before the $\delta$.

    Returns:
        `(metric value, values, gradients)`, the last two keyed alike.
    """
    catalogue = site_shapes(model, inputs, **kwargs)
    selection = select(catalogue, sites, what="sites")
    base = {} if not edits else edit_table(catalogue, edits)
    for site in selection:
        if not jnp.issubdtype(catalogue[site].dtype, jnp.floating):
            raise ConfigError(
                f"attribute: site {site!r} holds {catalogue[site].dtype} values "
                "(router choices); it has no gradient."
            )
    deltas = {s: jnp.zeros(catalogue[s].shape, catalogue[s].dtype) for s in selection}

    def run(deltas):
        table = {k: list(v) for k, v in base.items()}
        for site, delta in deltas.items():
            if site.startswith(STACKED):

                def add(v, layer, delta=delta):
                    return v + delta[layer]
            else:

                def add(v, layer, delta=delta):
                    return v + delta

            table.setdefault(site, []).append((add, None))
        hooks = Hooks(set(selection), table)
        out = call_with_hooks(model, inputs, hooks, kwargs)
        value = metric(out)
        if jnp.shape(value) != ():
            raise ConfigError(
                f"attribute: metric must return a scalar, got shape {jnp.shape(value)}."
            )
        return value, hooks.values

    (value, values), grads = jax.value_and_grad(run, has_aux=True)(deltas)
    return value, unpack(values, selection, model=model), unpack(grads, selection)
