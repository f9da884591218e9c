"""Packed sequences: a packed batch equals each document run alone."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blocklab as bl
from blocklab._validate import ConfigError
from blocklab.nn import attention_impls
from blocklab.nn.functional import segment_positions

DOCS = [np.array([3, 1, 4, 1, 5]), np.array([9, 2, 6, 5, 3, 5, 8, 9]), np.array([7, 9])]


def _model(positions, seed=0, **extra):
    cfg = bl.DecoderConfig(
        vocab_size=12, num_hiddens=16, num_heads=4, num_kv_heads=2, num_blks=1,
        max_len=32, positions=positions, **extra,
    )  # fmt: skip
    return bl.DecoderLM(cfg, key=jax.random.key(seed))


def test_segment_positions_hand_worked():
    seg = jnp.array([[0, 0, 0, 1, 1, 2], [4, 4, 4, 4, 4, 4]])
    np.testing.assert_array_equal(
        segment_positions(seg), [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 4, 5]]
    )


@pytest.mark.parametrize(
    "positions, impl",
    [
        pytest.param("rope", "reference", marks=pytest.mark.slow),
        ("learned", "reference"),
        ("rope", "chunked"),  # RoPE positions restart: checked here by default
    ],
)
def test_packed_logits_equal_each_document_alone(positions, impl, monkeypatch):
    monkeypatch.setattr(attention_impls, "BLOCK_SIZE", 4)
    model = bl.with_attention_impl(
        _model(positions, window=3 if impl == "chunked" else None), impl
    )
    ids = jnp.asarray(np.concatenate(DOCS))
    seg = jnp.asarray(np.concatenate([[i] * len(d) for i, d in enumerate(DOCS)]))
    # a batch of two rows: the packed row and the same documents in another order
    order = [2, 0, 1]
    ids2 = jnp.asarray(np.concatenate([DOCS[i] for i in order]))
    seg2 = jnp.asarray(np.concatenate([[i] * len(DOCS[i]) for i in order]))
    packed = model(jnp.stack([ids, ids2]), segment_ids=jnp.stack([seg, seg2]))
    for row, docs in ((0, DOCS), (1, [DOCS[i] for i in order])):
        start = 0
        for doc in docs:
            alone = model(jnp.asarray(doc))
            got = packed[row, start : start + len(doc)]
            np.testing.assert_allclose(got, alone, atol=1e-5, rtol=1e-5)
            start += len(doc)


def test_packed_loss_equals_the_loss_of_separate_documents():
    model = _model("rope", seed=1)
    windows, seg = bl.TokenDataset.pack_documents(DOCS, seq_len=6)
    X, Y = jnp.asarray(windows[:, :-1]), jnp.asarray(windows[:, 1:])
    loss = bl.lm_loss(model, X, Y, segment_ids=jnp.asarray(seg))
    # reference: each document piece in each window alone, its own targets only
    total, count = 0.0, 0
    for w, s in zip(windows, seg, strict=True):
        for k in np.unique(s[s >= 0]):
            piece = w[s == k]
            if len(piece) < 2:
                continue
            logits = model(jnp.asarray(piece[:-1]))
            ce = optax.softmax_cross_entropy_with_integer_labels(
                logits, jnp.asarray(piece[1:])
            )
            total, count = total + float(jnp.sum(ce)), count + len(piece) - 1
    np.testing.assert_allclose(float(loss), total / count, rtol=1e-5)
    # every stream target except the documents' first tokens counts once
    assert count == sum(len(d) for d in DOCS) - len(DOCS)
    # (B, T) segment ids of the inputs give the same loss here: no window's last
    # target starts a new document
    loss_bt = bl.lm_loss(model, X, Y, segment_ids=jnp.asarray(seg[:, :-1]))
    np.testing.assert_allclose(float(loss_bt), float(loss), rtol=1e-6)


def test_pack_documents_hand_worked():
    w, s = bl.TokenDataset.pack_documents(
        [np.array([1, 2, 3, 4, 5]), np.array([10, 11, 12, 13]), np.array([30, 31])], 4
    )
    np.testing.assert_array_equal(
        w, [[1, 2, 3, 4, 5], [5, 10, 11, 12, 13], [13, 30, 31, 0, 0]]
    )
    np.testing.assert_array_equal(
        s, [[0, 0, 0, 0, 0], [0, 1, 1, 1, 1], [0, 1, 1, -1, -1]]
    )


def test_bad_segment_ids_are_named(plain_python):
    model = _model("rope")
    ids = jnp.zeros((2, 6), jnp.int32)
    with pytest.raises(ConfigError, match="segment_ids.*shape"):
        model(ids, segment_ids=jnp.zeros((2, 5), jnp.int32))
    with pytest.raises(ConfigError, match="segment_ids.*integer dtype"):
        model(ids, segment_ids=jnp.zeros((2, 6), jnp.float32))
    with pytest.raises(ConfigError, match="segment_ids"):
        bl.lm_loss(model, ids, ids, segment_ids=jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(ConfigError, match="documents"):
        bl.TokenDataset.pack_documents([np.array([], int)], 4)


@pytest.mark.parametrize(
    ("doc", "bad"), [([7, 2**40, 1], 2**40), ([3, -5, 2], -5)], ids=["huge", "negative"]
)
def test_pack_documents_refuses_ids_that_int32_cannot_hold(doc, bad):
    """2**40 would wrap to 0 and -5 would pack as -5: both are refused, naming
    the document, the position and the id."""
    with pytest.raises(ConfigError, match=rf"documents\[0\]\[1\] = {bad} is not a"):
        bl.data.pack_documents([np.array(doc, np.int64)], 4)


@pytest.mark.parametrize("positions", ["rope", "learned"])
def test_a_reused_segment_id_starts_a_new_segment(positions):
    """[0, 0, 1, 1, 0, 0, 0, 0]: the third run reuses id 0. Its positions
    restart (segment_positions), so it must also see only itself: its logits
    are those of the document alone, and the whole row equals the one with
    ids [0, 0, 1, 1, 2, 2, 2, 2] (attention joined the runs before)."""
    model = _model(positions)
    ids = jnp.array([[5, 9, 2, 7, 3, 8, 1, 4]], jnp.int32)
    reused = jnp.array([[0, 0, 1, 1, 0, 0, 0, 0]], jnp.int32)
    distinct = jnp.array([[0, 0, 1, 1, 2, 2, 2, 2]], jnp.int32)
    got = model(ids, segment_ids=reused)
    np.testing.assert_array_equal(got, model(ids, segment_ids=distinct))
    alone = model(ids[:, 4:])
    np.testing.assert_allclose(got[:, 4:], alone, rtol=1e-5, atol=1e-5)
    first = model(ids[:, :2])
    np.testing.assert_allclose(got[:, :2], first, rtol=1e-5, atol=1e-5)
