"""The attention mask value (`blocklab.nn.mask.Mask`) against a NumPy loop
with the rule written out, alone and combined, and every attention_impl
given the same mask against a float64 NumPy attention."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.nn.attention import MultiHeadAttention
from blocklab.nn.mask import Mask, as_mask


def _runs(seg):
    """Segments as runs of equal ids, numbered along the sequence."""
    out, cur = [], 0
    for i, s in enumerate(seg):
        if i and s != seg[i - 1]:
            cur += 1
        out.append(cur)
    return out


def _loop(Tq, Tk, *, causal=False, lens=None, valid=None, seg=None, window=None,
          bidir=False, chunk=None, offset=0):  # fmt: skip
    """The visibility of one sequence, one (query, key) pair at a time."""
    runs = None if seg is None else _runs(list(seg))
    out = np.zeros((Tq, Tk), bool)
    for i in range(Tq):
        n = offset + i
        for j in range(Tk):
            ok = True
            if causal:
                ok &= j <= n
            if lens is not None:
                ok &= j < int(np.broadcast_to(lens, (Tq,))[i])
            if valid is not None:
                ok &= bool(valid[j])
            if runs is not None:
                ok &= runs[i] == runs[j]
            if window is not None and window > 0:
                right = n + (window - 1 if bidir else 0)
                ok &= n - window < j <= right
            if chunk is not None:
                ok &= n // chunk == j // chunk
            out[i, j] = ok
    return out


T = 11
SEG = [0, 0, 0, 1, 1, 1, 1, 0, 0, 2, 2]
VALID = np.array([True] * 9 + [False] * 2)
LENS = np.array([3, 5, 5, 7, 7, 9, 9, 9, 11, 11, 11])

OPTIONS = {
    "causal": (Mask.causal(), dict(causal=True)),
    "lengths": (Mask.lengths(jnp.asarray(LENS)), dict(lens=LENS)),
    "padding": (Mask.padding(jnp.asarray(VALID)), dict(valid=VALID)),
    "segments": (Mask.segments(jnp.asarray(SEG)), dict(seg=SEG)),
    "window": (Mask.sliding(3), dict(window=3)),
    "bidir_window": (Mask.sliding(3, "bidirectional"), dict(window=3, bidir=True)),
    "chunked": (Mask.chunked(4), dict(chunk=4)),
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_each_option_matches_the_loop(name):
    mask, kw = OPTIONS[name]
    got = np.asarray(mask.visible((), T, T))
    np.testing.assert_array_equal(got, _loop(T, T, **kw))


def _combined(names):
    mask, kw = Mask(), {}
    for n in names:
        m, k = OPTIONS[n]
        mask = mask & m
        kw.update(k)
    return mask, kw


COMBOS = [
    c
    for r in (2, 3, 4)
    for c in itertools.combinations(sorted(OPTIONS), r)
    if not {"window", "bidir_window"} <= set(c)
]


@pytest.mark.parametrize("names", COMBOS, ids="&".join)
def test_combined_masks_match_the_loop(names):
    mask, kw = _combined(names)
    got = np.asarray(mask.visible((), T, T))
    np.testing.assert_array_equal(got, _loop(T, T, **kw))


def test_offset_is_the_cache_rule():
    """Queries at key indices start + i of a longer key axis."""
    mask = Mask.causal() & Mask.offset(jnp.asarray([2, 5])) & Mask.sliding(3)
    got = np.broadcast_to(mask.visible((2,), 3, 9), (2, 3, 9))
    for b, o in enumerate((2, 5)):
        np.testing.assert_array_equal(
            got[b], _loop(3, 9, causal=True, window=3, offset=o)
        )


def test_rule_is_the_same_mask():
    """The kernels' MaskRule evaluates to the reference's matrix."""
    mask, _ = _combined(("causal", "chunked", "padding", "segments"))
    mask = mask & Mask.sliding(5)
    B = 2
    rule = mask.rule((B,), T, T)
    np.testing.assert_array_equal(
        np.asarray(rule.full(T)), np.broadcast_to(mask.visible((B,), T, T), (B, T, T))
    )


def test_plain_lengths_read_as_valid_lens():
    m = as_mask(jnp.asarray(4))
    assert isinstance(m, Mask) and m.lens is not None
    assert as_mask(None) is None
    with pytest.raises(ConfigError, match="must be a Mask"):
        as_mask("causal")
    with pytest.raises(ConfigError, match="chunk"):
        Mask.chunked(4) & Mask.chunked(3)
    with pytest.raises(ConfigError, match="mode"):
        Mask.sliding(3, "left")


def _np_attention(attn, x, visible):
    """The layer's maths in float64 with the mask written out."""
    p, H, KV = attn.head_dim, attn.num_heads, attn.num_kv_heads
    f = lambda lin: np.asarray(lin.weight, np.float64)  # noqa: E731
    x = np.asarray(x, np.float64)
    q = (x @ f(attn.W_q).T).reshape(T, H, p)
    k = (x @ f(attn.W_k).T).reshape(T, KV, p)
    v = (x @ f(attn.W_v).T).reshape(T, KV, p)
    out = np.zeros((T, H, p))
    for h in range(H):
        g = h // (H // KV)
        for i in range(T):
            s = q[i, h] @ k[:, g].T / np.sqrt(p)
            s = np.where(visible[i], s, -1e6)
            w = np.exp(s - s.max())
            out[i, h] = (w / w.sum()) @ v[:, g]
    return out.reshape(T, H * p) @ f(attn.W_o).T


MASKS = [
    ("causal&segments&window", ("causal", "segments"), 4),
    ("lengths&segments&window", ("lengths", "segments"), 3),
    ("causal&chunked", ("causal", "chunked"), None),
    ("chunked&padding", ("chunked", "padding"), None),
    ("padding&segments&bidir", ("padding", "segments"), -3),
]


@pytest.mark.parametrize("impl", ["reference", "fused", "chunked"])
@pytest.mark.parametrize("case", MASKS, ids=[m[0] for m in MASKS])
def test_every_impl_gives_the_numpy_attention(impl, case, monkeypatch):
    from blocklab.nn import attention_impls

    monkeypatch.setattr(attention_impls, "BLOCK_SIZE", 4)  # several blocks
    _, names, window = case
    mask, kw = _combined(names)
    if window is not None:
        mode = "bidirectional" if window < 0 else "causal"
        mask = mask & Mask.sliding(abs(window), mode)
        kw.update(window=abs(window), bidir=window < 0)
    attn = MultiHeadAttention(
        16, 4, num_kv_heads=2, attention_impl=impl, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (T, 16))
    want = _np_attention(attn, x, _loop(T, T, **kw))
    got = np.asarray(attn(x, mask))
    assert got.dtype == np.float32
    scale = np.max(np.abs(want))
    np.testing.assert_allclose(got, want, atol=1e-5 * scale, rtol=0)
