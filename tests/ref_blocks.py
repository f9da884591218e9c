"""A blocklab TransformerBlock loaded with the weights of a random state dict
of tests/reference.py, for the tests that check the block against the NumPy
float64 reference.

This module is a helper imported by the tests, not a test file.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import reference as ref

import blocklab as bl


def block_and_dict(
    seed, d, heads, *, placement, norm, act, bias, qk_norm=False, dtype=jnp.float64
):
    """(block, state dict, rng): a float64 random state dict drawn from
    `np.random.default_rng(seed)` (qk-norm gains too where `qk_norm`), loaded
    in `dtype` into a `TransformerBlock(d, heads, ...)` of that structure; the
    generator, having drawn the weights, is left to draw the inputs."""
    rng = np.random.default_rng(seed)
    options = dict(act=act, placement=placement, bias=bias)
    sd = ref.random_state_dict(rng, d, norm_kind=norm, dtype=np.float64, **options)
    if qk_norm:
        ref.add_qk_norm(sd, rng, d // heads, dtype=np.float64)
    key = jax.random.key(seed)
    blk = bl.TransformerBlock(d, heads, norm=norm, qk_norm=qk_norm, key=key, **options)
    return bl.load_state_dict(blk, sd, dtype=dtype), sd, rng
