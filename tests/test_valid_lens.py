"""`valid_lens` on a batch `(B, T, d)`: every documented form, and no ambiguous one.

A 1-D lengths array on a batch whose `B == T` could mean one length per query
or one per sequence: it is refused, naming both forms (`(1, T)` per query,
`(B, 1)` per sequence), at every entry point that takes `valid_lens`; each
documented form equals a loop over single sequences (and a NumPy float64
loop for the softmax and the attention weights); the library's own causal
lengths, the losses, `generate(lengths=(B,))` and the muP activation RMS work
at `B == T`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import blocklab as bl
from blocklab import ConfigError
from blocklab.nn import functional as F

D, H = 16, 2


def _np_masked_softmax(scores, lens):
    """NumPy float64 loop: row (..., i) softmax over keys j < lens[..., i];
    a row with no visible key is uniform (the library's MASK_VALUE rule)."""
    s = np.asarray(scores, np.float64)
    lens = np.broadcast_to(np.asarray(lens), s.shape[:-1])
    out = np.zeros_like(s)
    for idx in np.ndindex(*s.shape[:-1]):
        L = min(int(lens[idx]), s.shape[-1])
        if L == 0:
            out[idx] = 1.0 / s.shape[-1]
            continue
        e = np.exp(s[idx][:L] - s[idx][:L].max())
        out[idx][:L] = e / e.sum()
    return out


@pytest.fixture(scope="module")
def mods():
    k = jax.random.split(jax.random.key(0), 4)

    def moe_block(key):
        def ffn_factory(*, key):
            return bl.MoEFeedForward(D, 4, 2, key=key)

        return bl.TransformerBlock(D, H, ffn_factory=ffn_factory, key=key)

    return {
        "mha": bl.MultiHeadAttention(D, H, num_kv_heads=1, key=k[0]),
        "block": bl.TransformerBlock(D, H, key=k[1]),
        "stack": bl.Stack(lambda kk: bl.TransformerBlock(D, H, key=kk), 2, key=k[2]),
        "moe_stack": bl.Stack(moe_block, 1, key=k[3]),
    }


#: Every entry point that takes `valid_lens` on a batch `x` of shape (B, T, D).
ENTRIES = {
    "masked_softmax": lambda m, x, L: F.masked_softmax(x[..., :, : x.shape[-2]], L),
    "attention-reference": lambda m, x, L: m["mha"](x, L, impl="reference"),
    "attention-chunked": lambda m, x, L: m["mha"](x, L, impl="chunked"),
    "attention-fused": lambda m, x, L: m["mha"](x, L, impl="fused"),
    "attention.trace": lambda m, x, L: m["mha"].trace(x, L).output,
    "block": lambda m, x, L: m["block"](x, L),
    "block.trace": lambda m, x, L: m["block"].trace(x, L).output,
    "stack": lambda m, x, L: m["stack"](x, L),
    "stack.scan": lambda m, x, L: m["stack"].scan(x, L)[0],
    "stack_moe_stats": lambda m, x, L: bl.nn.moe.stack_moe_stats(m["moe_stack"], x, L)[
        0
    ],
}


def _x(B, T, seed=1):
    # masked_softmax reads the first T columns as (B, T, T) scores: D >= T
    return jax.random.normal(jax.random.key(seed), (B, T, D))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("jit", [False, True])
def test_a_1d_lengths_array_on_a_batch_with_b_equal_t_is_refused_with_both_forms(
    mods, entry, jit, plain_python
):
    # (plain_python: the suite's run-time shape checker would catch the B != T
    # shape first, with a TypeCheckError)
    fn = ENTRIES[entry]
    if jit:
        fn = eqx.filter_jit(fn)
    x = _x(4, 4)
    with pytest.raises(ConfigError, match=r"ambiguous.*\(1, 4\).*\(4, 1\)") as err:
        fn(mods, x, jnp.array([4, 1, 3, 2]))
    assert "per query" in str(err.value) and "per sequence" in str(err.value)
    # a (B,) array with B != T never broadcasts as (T,): refused naming (B, 1)
    with pytest.raises(ConfigError, match=r"\(B, 1\) for one length per sequence"):
        fn(mods, _x(3, 4), jnp.array([4, 1, 3]))


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize(("B", "T"), [(4, 4), (5, 3)])
def test_every_documented_form_equals_a_loop_over_single_sequences(mods, entry, B, T):
    """(1, T) and (T,) per query, (B, 1) per sequence, (B, T) per both: the
    batch equals the loop of single sequences (T, d) with their (T,) lengths;
    a single sequence has no batch axis to confuse."""
    fn = eqx.filter_jit(ENTRIES[entry])
    x = _x(B, T, seed=B + T)
    rng = np.random.default_rng(B * 10 + T)
    per_query = rng.integers(1, T + 1, T)
    per_seq = rng.integers(1, T + 1, B)
    full = rng.integers(0, T + 2, (B, T))
    forms = [
        (per_query[None], np.broadcast_to(per_query, (B, T))),
        (per_seq[:, None], np.broadcast_to(per_seq[:, None], (B, T))),
        (full, full),
        (np.int32(2), np.full((B, T), 2)),
    ]
    if B != T:
        forms.append((per_query, np.broadcast_to(per_query, (B, T))))
    for given, rows in forms:
        out = np.asarray(fn(mods, x, jnp.asarray(given)))
        loop = np.stack(
            [np.asarray(fn(mods, x[b], jnp.asarray(rows[b]))) for b in range(B)]
        )
        np.testing.assert_allclose(out, loop, rtol=2e-5, atol=2e-6, err_msg=str(given))


@pytest.mark.parametrize(("B", "T"), [(4, 4), (3, 5)])
def test_masked_softmax_and_attention_weights_equal_a_numpy_loop(mods, B, T):
    rng = np.random.default_rng(B + T)
    scores = rng.normal(size=(B, T, T)).astype(np.float32)
    per_query = rng.integers(1, T + 1, T)
    per_seq = rng.integers(0, T + 1, B)
    for given in (per_query[None], per_seq[:, None]):
        got = F.masked_softmax(jnp.asarray(scores), jnp.asarray(given))
        np.testing.assert_allclose(got, _np_masked_softmax(scores, given), atol=1e-6)
        # the attention layer's weights: its logits through the same NumPy rule,
        # per head (lengths broadcast over the head axis)
        tr = mods["mha"].trace(_x(B, T), jnp.asarray(given))
        ref = _np_masked_softmax(tr.logits, np.asarray(given)[:, None])
        np.testing.assert_allclose(tr.weights, ref, atol=1e-6)
    # a single sequence: 1-D is per query, whatever its size
    one = F.masked_softmax(jnp.asarray(scores[0]), jnp.asarray(per_query))
    np.testing.assert_allclose(one, _np_masked_softmax(scores[0], per_query), atol=1e-6)


def test_the_ambiguity_rule_in_general():
    from blocklab.nn.functional import _ambiguous_lengths as amb

    assert (
        amb((4,), (4, 4)) and amb((4,), (2, 4, 4)) and amb((4, 4), (3, 4, 4)) is False
    )
    assert amb((4, 4), (4, 4, 4))  # per query over (B, T), or per sequence over (N, B)
    assert not amb((4,), (4,)) and not amb((1,), (4, 4)) and not amb((), (4, 4))
    assert (
        not amb((1, 4), (4, 4)) and not amb((4, 1), (4, 4)) and not amb((4, 4), (4, 4))
    )
    assert not amb((4,), (3, 4)) and not amb((3,), (3, 4))  # one reading only
    # causal_lengths has the full number of axes: never ambiguous
    for shape in [(4,), (4, 4), (2, 4, 4)]:
        c = F.causal_lengths(shape)
        assert c.ndim == len(shape) and not amb(c.shape, shape)
        assert np.array_equal(
            np.broadcast_to(c, shape)[..., :], np.broadcast_to(np.arange(1, 5), shape)
        )
    with pytest.raises(ConfigError, match="causal_lengths"):
        F.causal_lengths(())


@pytest.fixture(scope="module")
def lms():
    V = 11
    return {
        "charlm": bl.CharLM(V, D, H, 1, max_len=8, key=jax.random.key(5)),
        "llama": bl.DecoderLM(
            bl.DecoderConfig.llama(V, D, H, 1, num_kv_heads=1, max_len=8),
            key=jax.random.key(6),
        ),
    }


@pytest.mark.parametrize("name", ["charlm", "llama"])
def test_models_and_losses_use_causal_lengths_at_b_equal_t(lms, name):
    """The models' own causal lengths work on a batch with B == T: logits equal
    the loop over rows, and `lm_loss` equals the NumPy mean of the rows'
    cross-entropies."""
    model = lms[name]
    rng = np.random.default_rng(0)
    X = rng.integers(0, 11, (6, 6)).astype(np.int32)
    Y = rng.integers(0, 11, (6, 6)).astype(np.int32)
    logits = np.asarray(eqx.filter_jit(model)(X), np.float64)
    rows = np.stack([np.asarray(model(X[b]), np.float64) for b in range(6)])
    np.testing.assert_allclose(logits, rows, rtol=1e-5, atol=1e-5)
    z = rows - rows.max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -np.take_along_axis(logp, Y[..., None], -1).mean()
    loss = bl.training.losses.lm_loss(model, jnp.asarray(X), jnp.asarray(Y))
    np.testing.assert_allclose(float(loss), ce, rtol=1e-5)


def test_generate_lengths_are_one_per_row_also_when_b_equals_t(lms):
    """`generate(lengths=(B,))` with B == T: row b continues its first
    lengths[b] tokens, as generating that row alone does."""
    model = lms["charlm"]
    rng = np.random.default_rng(3)
    prompts = rng.integers(0, 11, (3, 3)).astype(np.int32)
    lengths = np.array([3, 1, 2], np.int32)
    out = np.asarray(bl.generate(model, prompts, 2, lengths=lengths))
    for b in range(3):
        L = int(lengths[b])
        alone = np.asarray(bl.generate(model, prompts[b, :L], 2))
        assert np.array_equal(out[b, : L + 2], alone), b


def test_mup_activation_rms_at_b_equal_t(lms):
    from blocklab.experiments.mup import activation_rms

    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 11, (6, 6)), jnp.int32)
    rms = activation_rms(lms["charlm"], tokens)
    assert all(np.isfinite(float(v)) for v in rms.values())
