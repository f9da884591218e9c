"""Compile once per configuration: chex guards against retracing.

`chex.assert_max_traces(fn, n)` counts the calls of `fn` that receive tracers,
i.e. the times JAX traces it. Each test warms a configuration up once, then
arms a guard before every further call: the forward pass may be traced once
per call (`train` checks the loss and the batch source abstractly, with
`jax.eval_shape`, before any work; no compilation), and no more. A retrace
of the compiled chunk program (between chunks, or on a second call with new
values of the same shapes) or of the validation would be a second trace and
raises; a changed configuration must retrace, which shows the guard can fail.
`signal_stats` has no abstract check: its guard allows no trace at all.

Also: the block under `chex.variants` (with and without `jit`) against the
NumPy float64 reference, compared with `chex.assert_trees_all_close`.
"""

import chex
import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import reference as ref

import blocklab as bl
import blocklab.diagnostics.propagation as signal_module

CHEX_PREFIX = "[Chex]"


def _forward(model, ids):
    return model(ids)


#: The forward pass the counted models call, looked up at trace time (so
#: swapping it never changes a compiled program's cache key).
ACTIVE = {"forward": _forward}


class Counted(eqx.Module):
    """A model whose forward pass goes through `ACTIVE["forward"]`."""

    inner: eqx.Module

    def __call__(self, ids, *, key=None):
        return ACTIVE["forward"](self.inner, ids)


@pytest.fixture
def guard():
    """`guard()` before a call: the forward pass may be traced at most once in it
    (the abstract check, not a compilation)."""
    chex.clear_trace_counter()

    def arm():
        chex.clear_trace_counter()
        ACTIVE["forward"] = chex.assert_max_traces(_forward, n=1)

    yield arm
    ACTIVE["forward"] = _forward
    chex.clear_trace_counter()


@pytest.fixture(scope="module")
def data():
    return bl.TimeMachine(seq_len=8, num_train=256, num_val=32)


def _model(key, data, d=16):
    return Counted(
        bl.CharLM(data.vocab_size, num_hiddens=d, num_heads=2, num_blks=1, key=key)
    )


def test_train_lm_chunks_compile_once(guard, data):
    opt = optax.adamw(1e-3, weight_decay=0.0)
    kw = dict(batch_size=2, steps_per_call=2, progress=False)
    bl.train_lm(
        _model(jax.random.key(0), data), data, opt, 2, key=jax.random.key(1), **kw
    )
    guard()
    # three chunks of the same length, new weights and batches: no retrace
    result = bl.train_lm(
        _model(jax.random.key(2), data), data, opt, 6, key=jax.random.key(3), **kw
    )
    assert np.asarray(result.losses).shape == (6,)
    # a changed configuration (batch size) must retrace: the guard can fail
    guard()
    with pytest.raises(AssertionError, match="traced > 1 times"):
        bl.train_lm(
            _model(jax.random.key(2), data),
            data,
            opt,
            2,
            key=jax.random.key(3),
            **{**kw, "batch_size": 3},
        )


@pytest.mark.slow  # tests/test_sweep_hparams.py covers it in the fast suite
def test_train_sweep_compiles_once(guard, data):
    def make(k):
        return _model(k, data)

    kw = dict(run=bl.RunConfig(batch_size=2, steps_per_call=2, progress=False))
    bl.train_sweep(
        make,
        data,
        2,
        model_keys=[0, 1],
        data_keys=[0, 1],
        sweep=bl.SweepConfig(learning_rates=[1e-3, 1e-2]),
        **kw,
    )
    guard()
    # other seeds and rates (values, not shapes), three chunks: no retrace
    result = bl.train_sweep(
        make,
        data,
        6,
        model_keys=[2, 3],
        data_keys=[4, 5],
        sweep=bl.SweepConfig(learning_rates=[3e-3, 3e-2]),
        **kw,
    )
    assert np.asarray(result.losses).shape == (2, 6)


def test_signal_stats_compiles_once(monkeypatch):
    chex.clear_trace_counter()
    spread = bl.nn.functional.token_spread

    def stats(seed, T=8):
        k = jax.random.key(seed)
        stack = bl.chapter_stack("post", num_blks=2, num_hiddens=16, num_heads=2, key=k)
        X = jax.random.normal(jax.random.fold_in(k, 1), (1, T, 16))
        return bl.signal_stats(stack, X, jax.random.fold_in(k, 2))

    stats(0)  # warm-up: compiles this configuration
    monkeypatch.setattr(
        signal_module, "token_spread", chex.assert_max_traces(spread, 0)
    )
    for seed in (1, 2, 3):  # new weights and inputs, same shapes: no retrace
        assert stats(seed).token_spread.shape == (2,)
    with pytest.raises(AssertionError, match="traced > 0 times"):
        stats(0, T=12)  # a new sequence length must retrace
    chex.clear_trace_counter()


# ------------------------------------------------ chex.variants: jit and no jit
D, H, T = 16, 2, 6


@pytest.mark.float64  # the reference is a float64 NumPy block
class BlockVariants(chex.TestCase):
    """One block per placement, jitted and not, against NumPy float64."""

    @chex.variants(with_jit=True, without_jit=True)
    def test_block_matches_the_float64_reference(self):
        for placement in bl.nn.block.PLACEMENTS:
            rng = np.random.default_rng(0)
            sd = ref.random_state_dict(rng, D, placement=placement, dtype=np.float64)
            blk = bl.TransformerBlock(D, H, placement=placement, key=jax.random.key(0))
            blk = bl.load_state_dict(blk, sd, dtype=jnp.float64)
            x = rng.normal(0, 1, (T, D))
            lens = np.arange(1, T + 1)  # causal
            expected = ref.block(
                sd,
                x,
                H,
                norm_kind="rms",
                act="swiglu",
                placement=placement,
                valid_lens=lens,
            )
            got = self.variant(lambda x, v, blk=blk: blk(x, v))(
                jnp.asarray(x), jnp.asarray(lens)
            )
            assert got.dtype == jnp.float64
            chex.assert_trees_all_close(got, expected, rtol=1e-10, atol=1e-10)
