"""Initialization: the default linear layer and re-initialization schemes.

Defaults follow the Flax NNX initializers:
LeCun truncated-normal weights (variance $1/\\text{fan\\_in}$), zero biases,
unit norm gains. The re-initializers below return a *new* model in which every
`eqx.nn.Linear` and `eqx.nn.Embedding` weight has been replaced; biases, norm
gains and every other array are left as they were. Weights are in the PyTorch
layout `(out, in)`, so `fan_in = shape[-1]` and `fan_out = shape[-2]`; leading
axes (the block axis of a `Stack`) are treated as independent copies.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, PRNGKeyArray

from .._validate import check_bool, check_float, check_int, check_key

__all__ = ["linear", "xavier_uniform", "normal", "scale", "weights"]

_lecun = jax.nn.initializers.lecun_normal(in_axis=-1, out_axis=-2)


def linear(
    in_features: int, out_features: int, *, bias: bool, key: PRNGKeyArray
) -> eqx.nn.Linear:
    """An `eqx.nn.Linear` with LeCun truncated-normal weights and zero bias.

    The weight is drawn from a normal truncated at two standard deviations and
    rescaled so that its variance is exactly $1/\\text{in\\_features}$ (Flax's
    `lecun_normal`); the bias, when present, is zero.
    """
    in_features = check_int("init.linear", "in_features", in_features, min=1)
    out_features = check_int("init.linear", "out_features", out_features, min=1)
    bias = check_bool("init.linear", "bias", bias)
    key = check_key("init.linear", "key", key)
    layer = eqx.nn.Linear(in_features, out_features, use_bias=bias, key=key)
    w = _lecun(key, (out_features, in_features), jnp.float32)
    layer = eqx.tree_at(lambda m: m.weight, layer, w)
    if bias:
        bias_init = jnp.zeros(out_features, jnp.float32)
        layer = eqx.tree_at(lambda m: m.bias, layer, bias_init)
    return layer


def _is_weighted(node) -> bool:
    return isinstance(node, (eqx.nn.Linear, eqx.nn.Embedding))


def _weight_nodes(model):
    # Unannotated on purpose: `eqx.tree_at` calls it on a tree whose leaves
    # are placeholders, not arrays, which a run-time return check would reject.
    layers = jax.tree_util.tree_leaves(model, is_leaf=_is_weighted)
    return [layer.weight for layer in layers if _is_weighted(layer)]


def weights(model) -> list[Array]:
    """Every `Linear` / `Embedding` weight of `model`, in tree order."""
    return _weight_nodes(model)


def _replace(model, fn):
    """Apply `fn(index, weight) -> new weight` to every weight of `model`."""
    old = weights(model)
    new = [fn(i, w).astype(w.dtype) for i, w in enumerate(old)]
    return eqx.tree_at(_weight_nodes, model, new)


def xavier_uniform(model, *, key: PRNGKeyArray):
    r"""Xavier/Glorot uniform on every weight (Glorot & Bengio, 2010; the 2017 block).

    $W_{ij} \sim U(-a, a)$ with $a = \sqrt{6 / (\text{fan\_in} + \text{fan\_out})}$,
    so that $\mathrm{Var}\,W_{ij} = 2 / (\text{fan\_in} + \text{fan\_out})$.
    Each weight gets its own subkey of `key`.
    """
    key = check_key("init.xavier_uniform", "key", key)
    keys = jax.random.split(key, max(len(weights(model)), 1))

    def draw(i, w):
        fan_in, fan_out = w.shape[-1], w.shape[-2]
        limit = (6.0 / (fan_in + fan_out)) ** 0.5
        return jax.random.uniform(keys[i], w.shape, jnp.float32, -limit, limit)

    return _replace(model, draw)


def normal(model, std: float, *, key: PRNGKeyArray):
    r"""$W_{ij} \sim \mathcal N(0, \text{std}^2)$ on every weight (GPT-1 used 0.02)."""
    std = check_float("init.normal", "std", std, min=0.0)
    key = check_key("init.normal", "key", key)
    keys = jax.random.split(key, max(len(weights(model)), 1))
    return _replace(
        model, lambda i, w: std * jax.random.normal(keys[i], w.shape, jnp.float32)
    )


def scale(model, alpha: float):
    r"""Multiply every weight by `alpha`: $W \mapsto \alpha W$ (biases, gains stay).

    `alpha` is a finite real number (NaN and infinities are refused).
    """
    alpha = check_float("init.scale", "alpha", alpha)
    return _replace(model, lambda i, w: alpha * w)
