r"""One rule for optimizer hyperparameter values, shared by `train_model` and sweeps.

Each known optax hyperparameter has a valid interval; a value outside it
makes the run climb, blow up or divide by zero:

- `learning_rate` in $(0, \infty)$: $\theta \leftarrow \theta - \eta u$
  descends only for $\eta > 0$;
- `weight_decay` in $[0, \infty)$: $-\eta\lambda\theta$ with $\lambda < 0$
  grows the weights;
- `b1`, `b2`, `momentum`, `decay`, `rho` in $[0, 1)$: EMA decays; at
  $\ge 1$ the average never forgets (Adam's bias correction $1 - \beta^t$ is
  0 or negative);
- `eps`, `eps_root`, `initial_accumulator_value` in $[0, \infty)$: added
  under a square root or to a denominator.

Every other hyperparameter (a schedule's own arguments) must be finite.
`check_values` reads the values as `(K,)` arrays (K members; one run is
K = 1) and names the member and the value. A learning rate that is not a
hyperparameter (fixed inside an injected optimizer) is checked by
`climbs`: the first update for a gradient of ones must not point uphill.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._validate import ConfigError

__all__ = ["RANGES", "check_values", "climbs"]

_EMA = (0.0, 1.0, False, True)
_NONNEG = (0.0, math.inf, False, True)

#: name -> (low, high, low_open, high_open)
RANGES: dict[str, tuple[float, float, bool, bool]] = {
    "learning_rate": (0.0, math.inf, True, True),
    "weight_decay": _NONNEG,
    "b1": _EMA,
    "b2": _EMA,
    "momentum": _EMA,
    "decay": _EMA,
    "rho": _EMA,
    "eps": _NONNEG,
    "eps_root": _NONNEG,
    "initial_accumulator_value": _NONNEG,
}


def _interval(lo: float, hi: float, lo_open: bool, hi_open: bool) -> str:
    return f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"


def check_values(
    values: Mapping[str, Any], *, members: bool = True, _owner: str = "check_values"
) -> None:
    """Refuse a hyperparameter value outside its valid interval (see `RANGES`).

    Args:
        values: `{name: value or (K,) values}`.
        members: name the member (index into the `(K,)` values) in the message.

    Raises:
        ConfigError: naming the hyperparameter, the member, the value and the
            valid interval.
    """
    owner = _owner
    for name, value in values.items():
        if value is None or callable(value):
            continue
        arr = np.atleast_1d(np.asarray(value, np.float64))
        lo, hi, lo_open, hi_open = RANGES.get(name, (-math.inf, math.inf, True, True))
        bad = ~np.isfinite(arr)
        bad |= (arr <= lo) if lo_open else (arr < lo)
        bad |= (arr >= hi) if hi_open else (arr > hi)
        if bad.any():
            k = int(np.flatnonzero(bad.reshape(-1))[0])
            where = f" of member {k}" if members and arr.size > 1 else ""
            valid = (
                "in " + _interval(lo, hi, lo_open, hi_open)
                if name in RANGES
                else "finite"
            )
            got = float(arr.reshape(-1)[k])
            if not math.isfinite(got):
                valid = "finite"
            note = " (the learning rate must be > 0)" if name == "learning_rate" else ""
            raise ConfigError(
                f"{owner}: hyperparameter {name}{where} must be {valid}{note}, "
                f"got {got:.6g}."
            )


def climbs(optimizer: Any, opt_state: Any, model: Any) -> jax.Array:
    r"""$\sum_i u_i$ of the first update $u$ for the gradient $g = 1$.

    Positive means the update climbs the gradient (a negative learning rate
    fixed inside the optimizer). Vmap it over the members of a sweep.
    """
    params = eqx.filter(model, eqx.is_inexact_array)
    ones = jax.tree_util.tree_map(jnp.ones_like, params)
    updates, _ = optimizer.update(ones, opt_state, params)
    leaves = jax.tree_util.tree_leaves(updates)
    return sum(jnp.sum(u.astype(jnp.float32)) for u in leaves)
