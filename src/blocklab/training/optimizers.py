r"""`blocklab.optimizer`: an optax optimizer with the parametrization's per-leaf rates.

For a model, a base optimizer (Adam by default) with direction $\Delta_t$
(Adam's $\hat m_t / (\sqrt{\hat v_t} + \epsilon)$), a peak learning rate
$\eta$, per-leaf multipliers $\mu$ (`blocklab.nn.parametrization`: $1/m$ for
the hidden matrices under μP, 1 otherwise) and a schedule factor $s_t$, every
leaf $\theta$ moves by
$$\theta_{t+1} = \theta_t - s_t\,\big(\eta\,\mu\,\Delta_t + \lambda\,\theta_t\big),$$
with $\lambda$ = `weight_decay`, an *independent* weight decay (Loshchilov &
Hutter's decoupled form as Wortsman et al. 2023 use it: $\lambda$ is not
multiplied by $\eta$, so sweeping $\eta$ leaves the decay per step alone).

The schedule factor is a linear warm-up then an optional cosine decay:
$$s_t = \begin{cases} (t+1)/W & t < W\\
f + (1-f)\,\tfrac12\big(1 + \cos(\pi \min(1, (t-W)/D))\big) & t \ge W,\ D > 0\\
1 & t \ge W,\ D = 0\end{cases}$$
($t$ the 0-based step, $W$ = `warmup_steps`, $D$ = `decay_steps`, $f$ =
`final_fraction`).

Everything numeric ($\eta$, $\lambda$, $W$, $D$, $f$ and the base
optimizer's own arguments such as `b2`) is an `optax.inject_hyperparams`
hyperparameter in the optimizer state, so `blocklab.train_sweep` can give
every member its own value (`learning_rates=`, `hyperparams=`) under one
compiled step.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax
from jaxtyping import Array, ArrayLike, Float, Int, Real

from .._validate import ConfigError, check_float
from ..nn.parametrization import lr_multipliers

__all__ = ["optimizer", "schedule_factor"]

#: The hyperparameters `optimizer` itself owns (the rest go to the base).
OWN = ("learning_rate", "weight_decay", "warmup_steps", "decay_steps", "final_fraction")


def schedule_factor(
    step: Int[ArrayLike, ""],
    warmup_steps: Real[ArrayLike, ""] = 0.0,
    decay_steps: Real[ArrayLike, ""] = 0.0,
    final_fraction: Real[ArrayLike, ""] = 0.0,
) -> Float[Array, ""]:
    """$s_t$ of the module docstring: linear warm-up, then cosine or constant."""
    t = jnp.asarray(step, jnp.float32)
    W = jnp.asarray(warmup_steps, jnp.float32)
    D = jnp.asarray(decay_steps, jnp.float32)
    f = jnp.asarray(final_fraction, jnp.float32)
    warm = jnp.minimum(1.0, (t + 1.0) / jnp.maximum(W, 1.0))
    progress = jnp.clip((t - W) / jnp.maximum(D, 1.0), 0.0, 1.0)
    cosine = f + (1.0 - f) * 0.5 * (1.0 + jnp.cos(jnp.pi * progress))
    after = jnp.where(D > 0, cosine, 1.0)
    return jnp.where(t < W, warm, after)


class _CountState(NamedTuple):
    count: Int[Array, ""]


def _scale_and_decay(
    multipliers: Any, weight_decay: Any, factor: Callable[[Any], Any]
) -> optax.GradientTransformation:
    """$u \\mapsto \\mu u - s_t \\lambda \\theta$, leaf by leaf."""

    def init(params):
        del params
        return _CountState(jnp.zeros([], jnp.int32))

    def update(updates, state, params=None):
        if params is None:
            raise ConfigError(
                "blocklab.optimizer: the update needs the parameters "
                "(optimizer.update(grads, state, params)) for the weight decay."
            )
        s = factor(state.count)

        def one(u, mu, p):
            return (mu * u - (s * weight_decay) * p).astype(u.dtype)

        updates = jax.tree_util.tree_map(one, updates, multipliers, params)
        return updates, _CountState(optax.safe_increment(state.count))

    return optax.GradientTransformation(init, update)


def _check_multipliers(owner: str, model: Any, multipliers: Any) -> Any:
    expected = lr_multipliers(model)
    if multipliers is None:
        return expected
    want = jax.tree_util.tree_structure(expected)
    got = jax.tree_util.tree_structure(multipliers)
    if want != got:
        raise ConfigError(
            f"{owner}: multipliers must be a tree shaped like the model's "
            f"floating-point leaves (eqx.filter(model, eqx.is_inexact_array), "
            f"{want.num_leaves} leaves; blocklab.nn.parametrization.lr_multipliers"
            f"(model) builds one), got a tree with {got.num_leaves} leaves that "
            "does not match the model."
        )
    out = []
    for i, v in enumerate(jax.tree_util.tree_leaves(multipliers)):
        out.append(check_float(owner, f"multipliers leaf {i}", v, min=0.0))
    return jax.tree_util.tree_unflatten(want, out)


def _check_names(owner: str, fn: Callable[..., Any], hyperparams: dict) -> None:
    """Each hyperparameter is one of `OWN` or an argument of `fn` (unless `fn`
    takes `**kwargs`), so a misspelt name fails here, not in a later step."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: let optax decide
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    valid = set(OWN) | (set(params) - {"learning_rate"})
    for name in hyperparams:
        if name not in valid:
            raise ConfigError(
                f"{owner}: unknown hyperparameter {name!r} for "
                f"{getattr(fn, '__name__', fn)!s}; valid: {sorted(valid)}."
            )


def _check_hyper(owner: str, name: str, value: Any) -> Any:
    if name == "learning_rate" and callable(value):
        raise ConfigError(
            f"{owner}: learning_rate must be a number (the peak rate); give the "
            "schedule as warmup_steps=, decay_steps=, final_fraction=."
        )
    if name == "learning_rate":
        return check_float(owner, name, value, min=0.0, min_open=True)
    if name == "final_fraction":
        return check_float(owner, name, value, min=0.0, max=1.0)
    if name in OWN:
        return check_float(owner, name, value, min=0.0)
    if isinstance(value, (str, bytes)):
        raise ConfigError(
            f"{owner}: {name} must be a number, got {value!r} (a "
            f"{type(value).__name__}); write {name}=0.95, not {name}='0.95'."
        )
    return value


def optimizer(
    model: Any,
    base_optimizer_fn: Callable[..., optax.GradientTransformation] = optax.adam,
    *,
    multipliers: Any = None,
    **hyperparams: Any,
) -> optax.GradientTransformationExtraArgs:
    """The optimizer of `model`'s parametrization (module docstring).

    Args:
        model: a `DecoderLM` or `CharLM` (or its `eqx.filter_eval_shape`
            skeleton; any other module is trained as standard), whose
            parametrization gives the per-leaf multipliers.
        base_optimizer_fn: an optax optimizer factory taking `learning_rate`
            (a schedule) first, e.g. `optax.adam` (default), `optax.lion`.
        multipliers: a tree of per-leaf rate multipliers shaped like the
            model's floating-point leaves (default: the parametrization's,
            `blocklab.nn.parametrization.lr_multipliers(model)`).
        **hyperparams: `learning_rate` (peak $\\eta$ > 0, default 1.0 for a
            sweep that sets it per member), `weight_decay` ($\\lambda \\ge 0$,
            independent of $\\eta$; default 0), `warmup_steps`, `decay_steps`
            (>= 0, default 0), `final_fraction` (in [0, 1], default 0), and
            any numeric argument of `base_optimizer_fn` (e.g. `b2=0.95`).

    Returns:
        `optax.inject_hyperparams(...)(**hyperparams)`: each of them lives in
        `opt_state.hyperparams` (float32), so `train_sweep(...,
        sweep=SweepConfig(optimizer=..., learning_rates=...))` sweeps the
        base rate.

    Raises:
        ConfigError: a multiplier tree that does not match the model, a
            negative or non-finite `weight_decay` (or learning rate, schedule
            length), a non-callable base optimizer.
    """
    owner = "blocklab.optimizer"
    if not callable(base_optimizer_fn):
        raise ConfigError(
            f"{owner}: base_optimizer_fn must be an optax optimizer factory "
            f"(e.g. optax.adam), got {base_optimizer_fn!r}."
        )
    _check_names(owner, base_optimizer_fn, hyperparams)
    mult = _check_multipliers(owner, model, multipliers)
    values = dict(
        learning_rate=1.0, weight_decay=0.0, warmup_steps=0.0, decay_steps=0.0,
        final_fraction=0.0,
    )  # fmt: skip
    values.update(hyperparams)
    values = {k: _check_hyper(owner, k, v) for k, v in values.items()}

    def build(**hp):
        own = {k: hp.pop(k) for k in OWN}

        def factor(count):
            return schedule_factor(
                count, own["warmup_steps"], own["decay_steps"], own["final_fraction"]
            )

        inner = base_optimizer_fn(lambda c: own["learning_rate"] * factor(c), **hp)
        return optax.chain(inner, _scale_and_decay(mult, own["weight_decay"], factor))

    # inject_hyperparams binds arguments by signature: name every one of them.
    build.__signature__ = inspect.Signature(
        [inspect.Parameter(k, inspect.Parameter.KEYWORD_ONLY) for k in values]
    )
    return optax.inject_hyperparams(build, hyperparam_dtype=jnp.float32)(**values)
