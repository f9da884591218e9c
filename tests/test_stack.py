"""Stack: a scanned stack equals a Python loop over its blocks (forward, gradients)."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab import Stack, TransformerBlock

D, H, N, T = 16, 2, 3, 5
CAUSAL = jnp.arange(1, T + 1)


def make_stack(remat=False, **options):
    return Stack(
        lambda k: TransformerBlock(D, H, key=k, **options),
        N,
        remat=remat,
        key=jax.random.key(1),
    )


def loop(blocks, x, valid_lens):
    for blk in blocks:
        x = blk(x, valid_lens)
    return x


@pytest.fixture
def x():
    return jax.random.normal(jax.random.key(2), (T, D), jnp.float32)


@pytest.mark.parametrize(
    "options, transform",
    [({}, "eager"), (dict(act="gelu", placement="post", norm="layer"), "jit")],
)
def test_forward_equals_python_loop(x, options, transform):
    stack = make_stack(**options)
    fn = stack if transform == "eager" else eqx.filter_jit(stack)
    expected = loop([stack.block(i) for i in range(N)], x, CAUSAL)
    np.testing.assert_allclose(fn(x, CAUSAL), expected, rtol=1e-5, atol=1e-6)


def test_blocks_differ_and_index_like_a_sequence():
    stack = make_stack()
    w = [stack[i].attention.W_q.weight for i in range(N)]
    assert not np.allclose(w[0], w[1])
    np.testing.assert_array_equal(stack[-1].attention.W_q.weight, w[-1])
    assert len(stack) == N
    assert isinstance(stack.block(0), TransformerBlock)


def test_per_block_gradients_come_out_stacked(x):
    stack = make_stack()
    r = jax.random.normal(jax.random.key(3), (T, D), jnp.float32)

    def stack_loss(s):
        return jnp.sum(s(x, CAUSAL) * r)

    def loop_loss(blocks):
        return jnp.sum(loop(blocks, x, CAUSAL) * r)

    g_stack = eqx.filter_jit(eqx.filter_grad(stack_loss))(stack)
    g_loop = eqx.filter_jit(eqx.filter_grad(loop_loss))(
        [stack.block(i) for i in range(N)]
    )
    for i in range(N):
        for a, b in zip(
            jax.tree_util.tree_leaves(g_stack.block(i)),
            jax.tree_util.tree_leaves(g_loop[i]),
            strict=True,
        ):
            assert a.shape == b.shape
            np.testing.assert_allclose(
                a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max())
            )
    # every array of the gradient has the leading block axis
    assert all(g.shape[0] == N for g in jax.tree_util.tree_leaves(g_stack.blocks))


def test_remat_gives_the_same_numbers(x):
    plain, remat = make_stack(), make_stack(remat=True)

    def loss(s):
        return jnp.sum(s(x, CAUSAL) ** 2)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l_remat, g_remat), (l_plain, g_plain) = grad(remat), grad(plain)
    np.testing.assert_allclose(l_remat, l_plain, rtol=1e-6)
    for a, b in zip(
        jax.tree_util.tree_leaves(g_remat),
        jax.tree_util.tree_leaves(g_plain),
        strict=True,
    ):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_scan_collects_per_block_stats(x):
    stack = make_stack()

    def collect(blk, h, key):
        out = blk(h, CAUSAL, key=key)
        return out, jnp.sqrt(jnp.mean(out**2))

    _, rms = eqx.filter_jit(lambda s: s.scan(x, CAUSAL, collect=collect))(stack)
    h, expected = x, []
    for i in range(N):
        h = stack.block(i)(h, CAUSAL)
        expected.append(float(jnp.sqrt(jnp.mean(h**2))))
    np.testing.assert_allclose(rms, expected, rtol=1e-5)


def test_bad_depth_and_index_raise():
    with pytest.raises(ValueError, match="num_blks must be a positive int, got 0"):
        Stack(lambda k: TransformerBlock(D, H, key=k), 0, key=jax.random.key(0))
    with pytest.raises(IndexError, match="block index 3 out of range for a Stack of 3"):
        make_stack().block(3)


def test_positions_reach_every_block(x):
    def make(key):
        return TransformerBlock(D, H, rope_theta=100.0, num_kv_heads=1, key=key)

    stack = Stack(make, N, key=jax.random.key(0))
    packed = jnp.array([0, 1, 2, 0, 1])  # two packed sequences
    h = x
    for i in range(N):
        h = stack.block(i)(h, CAUSAL, positions=packed)
    np.testing.assert_allclose(
        stack(x, CAUSAL, positions=packed), h, rtol=1e-5, atol=1e-6
    )
    out, _ = stack.scan(x, CAUSAL, positions=packed)
    np.testing.assert_allclose(out, h, rtol=1e-5, atol=1e-6)
    assert not np.allclose(stack(x, CAUSAL), h, atol=1e-4)  # default arange(T)


def test_layer_inputs_reach_their_own_block_in_one_scan(x):
    """`layer_inputs` gives block i slice i (an array, or a `PerLayer`'s
    `fn(layers_i, shared)`), equal to a loop over the blocks, in one scan."""
    from blocklab._validate import ConfigError
    from blocklab.nn.stack import PerLayer

    stack = make_stack()
    bias = jax.random.normal(jax.random.key(4), (N, H, T, T), jnp.float32)
    tables = jax.random.normal(jax.random.key(5), (N, 4, H), jnp.float32)
    grid = jnp.arange(T * T).reshape(T, T) % 4

    def gather(w, g):
        return jnp.moveaxis(w[g], -1, -3)

    @jax.jit
    def run(stack, bias, tables):
        out = []
        for per, each in (
            (bias, list(bias)),
            (PerLayer(tables, grid, gather), [gather(t, grid) for t in tables]),
        ):
            h = x
            for i in range(N):
                h = stack.block(i)(h, CAUSAL, score_bias=each[i])
            out.append((stack(x, CAUSAL, layer_inputs={"score_bias": per}), h))
        return out, stack(x, CAUSAL, score_bias=bias[0])

    pairs, first = run(stack, bias, tables)
    for got, want in pairs:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert not np.allclose(first, pairs[0][1], atol=1e-4)

    def call(s, b):
        return s(x, CAUSAL, layer_inputs={"score_bias": b})

    jaxpr = jax.make_jaxpr(call)(stack, bias)
    assert str(jaxpr).count("scan[") == 1
    with pytest.raises(ConfigError, match="leading axis of size num_blks=3"):
        stack(x, CAUSAL, layer_inputs={"score_bias": bias[:2]})
