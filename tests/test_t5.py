"""T5: relative position buckets and bias, the family's conversion, generation.

The buckets are checked against a NumPy port of the formula (written here from
T5's definition, float32 as Mesh TensorFlow computes it), the worked table of
the reference notes, and `transformers`' `T5Attention._relative_position_bucket`.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.nn.relative_position import (
    RelativePositionBias,
    bucket_table,
    relative_position_bucket,
)


def _np_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's bucket of each relative position (key - query), one at a time."""
    out = []
    for r in np.ravel(rel):
        n = num_buckets
        b = 0
        if bidirectional:
            n //= 2
            b = n if r > 0 else 0
            d = abs(int(r))
        else:
            d = max(-int(r), 0)
        m = n // 2
        if d < m:
            b += d
        else:
            x = np.float32(np.log(np.float32(d) / np.float32(m)))
            x = np.float32(x / np.float32(math.log(max_distance / m)))
            x = np.float32(x * np.float32(n - m))
            b += min(m + int(x), n - 1)  # int(): truncation toward zero
        out.append(b)
    return np.array(out).reshape(np.shape(rel))


def test_worked_table():
    """The table of the reference notes (nb=8, max_distance=20), by hand."""
    rel = np.arange(-25, 26)
    bi = np.asarray(relative_position_bucket(rel, num_buckets=8, max_distance=20))
    want = {r: 3 for r in range(-25, -6)}
    want.update({r: 2 for r in range(-6, -1)})
    want.update({-1: 1, 0: 0, 1: 5})
    want.update({r: 6 for r in range(2, 7)})
    want.update({r: 7 for r in range(7, 26)})
    assert bi.tolist() == [want[r] for r in rel]
    causal = np.asarray(
        relative_position_bucket(
            rel, bidirectional=False, num_buckets=8, max_distance=20
        )
    )
    want = {0: 0, -1: 1, -2: 2, -3: 3, -4: 4, -5: 4}
    want.update({r: 5 for r in range(-8, -5)})
    want.update({r: 6 for r in range(-13, -8)})
    want.update({r: 7 for r in range(-25, -13)})
    want.update({r: 0 for r in range(1, 26)})
    assert causal.tolist() == [want[r] for r in rel]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(
    "num_buckets,max_distance", [(32, 128), (16, 128), (8, 20), (6, 7), (40, 300)]
)
def test_buckets_match_numpy_port(bidirectional, num_buckets, max_distance):
    rel = np.arange(-3 * max_distance, 3 * max_distance + 1)
    got = jax.jit(
        lambda r: relative_position_bucket(
            r,
            bidirectional=bidirectional,
            num_buckets=num_buckets,
            max_distance=max_distance,
        )
    )(rel)
    want = _np_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(np.asarray(got), want)


_SWEEP = [(nb, M) for nb in (4, 6, 10, 33, 64) for M in (5, 8, 20, 64, 200)]


@pytest.mark.parametrize(
    "sweep",
    [
        [(32, 128), (16, 128), (8, 20)],
        pytest.param(_SWEEP, marks=pytest.mark.slow),
    ],
    ids=["t5", "sweep"],
)
def test_buckets_match_transformers(sweep):
    """Both directions, over offsets past the maximum distance, including the
    float32 boundaries (n = 16, M = 128: d = 16, 32, 64 are exact powers of
    the log base)."""
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    bucket = t5.T5Attention._relative_position_bucket
    for nb, M in sweep:
        for bi in (True, False):
            n = nb // 2 if bi else nb
            if M <= n // 2:
                continue
            rel = np.arange(-2 * M - 3, 2 * M + 4)
            want = bucket(
                torch.tensor(rel), bidirectional=bi, num_buckets=nb, max_distance=M
            ).numpy()
            got = relative_position_bucket(
                rel, bidirectional=bi, num_buckets=nb, max_distance=M
            )
            np.testing.assert_array_equal(
                np.asarray(got), want, err_msg=f"nb={nb} M={M} bi={bi}"
            )


def test_bucket_table_ends_in_last_bucket():
    t = bucket_table(32, 128)
    assert t.shape == (129,) and t[-1] == 15 and t[:8].tolist() == list(range(8))
    assert np.all(np.diff(t) >= 0)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_buckets=2, max_distance=10), "num_buckets"),
        (dict(num_buckets=32, max_distance=8), "max_distance"),
        (dict(num_buckets=0, max_distance=8), "num_buckets"),
    ],
)
def test_degenerate_buckets_refused(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        relative_position_bucket(np.arange(3), **kwargs)


def test_bias_gathers_table_per_head():
    """B[h, i, j] = W[bucket(j - (offset + i)), h], by a Python loop."""
    bias = RelativePositionBias(
        3, num_buckets=8, max_distance=20, bidirectional=False, key=jax.random.key(0)
    )
    W = np.asarray(bias.weight)
    out = np.asarray(bias(4, 9, offset=5))
    assert out.shape == (3, 4, 9)
    for i in range(4):
        for j in range(9):
            b = _np_bucket(np.array([j - (5 + i)]), False, 8, 20)[0]
            np.testing.assert_array_equal(out[:, i, j], W[b])
    # per-sequence offsets (traced): a batch of biases
    many = jax.jit(lambda o: bias(1, 9, offset=o))(jnp.array([5, 6, 7, 8]))
    np.testing.assert_array_equal(np.asarray(many)[:, :, 0], out.transpose(1, 0, 2))


def test_bias_matches_transformers_compute_bias():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    cfg = transformers.T5Config(
        d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=12,
        relative_attention_max_distance=30,
    )  # fmt: skip
    for is_decoder in (False, True):
        cfg.is_decoder = is_decoder
        att = T5Attention(cfg, has_relative_attention_bias=True)
        with torch.no_grad():
            att.relative_attention_bias.weight.normal_()
        want = att.compute_bias(7, 40, past_seen_tokens=33).detach().numpy()[0]
        ours = RelativePositionBias(
            4, num_buckets=12, max_distance=30, bidirectional=not is_decoder,
            key=jax.random.key(1),
        )  # fmt: skip
        table = jnp.asarray(att.relative_attention_bias.weight.detach().numpy())
        ours = eqx.tree_at(lambda b: b.weight, ours, table)
        got = np.asarray(ours(7, 40, offset=33))
        np.testing.assert_array_equal(got, want)
