"""Linear regression for the training tests: a linear model, a batch source, a loss.

`train_model` and `train_sweep` take any model, loss and batch source; these
are the smallest ones, whose runs a float64 NumPy loop reproduces by hand.

This module is a helper imported by the tests, not a test file.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

D, B = 3, 5  # features, rows per batch
W_TRUE = np.array([1.0, -2.0, 0.5], np.float32)


class Linear(eqx.Module):
    """`x @ w + b`; `x @ w` when built without `b`."""

    w: jax.Array
    b: jax.Array | None = None

    def __call__(self, x):
        return x @ self.w if self.b is None else x @ self.w + self.b


def regression_batch(key):
    """A batch source as a plain callable: y = x . w_true + 0.1 noise."""
    kx, kn = jax.random.split(key)
    x = jax.random.normal(kx, (B, D), jnp.float32)
    return x, x @ W_TRUE + 0.1 * jax.random.normal(kn, (B,), jnp.float32)


def mse(model, batch, key):
    x, y = batch
    return jnp.mean((model(x) - y) ** 2)
