"""blocklab in a dozen lines: a block, a sequence, a batch, a causal mask, a census."""

import os

import jax
import jax.numpy as jnp

import blocklab as bl

d, T, B = (32, 8, 2) if os.environ.get("BLOCKLAB_TINY") else (256, 64, 8)
block = bl.TransformerBlock(d, num_heads=8, key=jax.random.key(0))  # pre-RMSNorm SwiGLU
x = jax.random.normal(jax.random.key(1), (T, d))
y = block(x)  # one sequence: (T, d) -> (T, d)
xs = jax.random.normal(jax.random.key(2), (B, T, d))
ys = jax.vmap(block)(xs)  # a batch is a vmap
causal = jnp.arange(1, T + 1)  # query t sees keys 0..t
yc = jax.jit(jax.vmap(block, in_axes=(0, None)))(xs, causal)
print("shapes:", y.shape, ys.shape, yc.shape)
print("census:", bl.census(block))
