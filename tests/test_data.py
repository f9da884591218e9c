"""The Time Machine corpus: preprocessing, vocabulary, windows, batches and errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.data import VOCAB, TimeMachine, TokenDataset, decode, encode, preprocess


def test_preprocess_collapses_non_letters_and_lowercases():
    assert preprocess("Hello, World!! 42x\n\nEnd.") == "hello world x end "
    assert preprocess("--a--") == " a "


def test_vocab_is_d2l_sorted_28_symbols():
    assert len(VOCAB) == 28
    assert VOCAB[:3] == (" ", "<unk>", "a") and VOCAB[-1] == "z"
    assert list(VOCAB) == sorted(VOCAB)


def test_encode_decode_round_trip_and_unknown():
    ids = encode("the time")
    np.testing.assert_array_equal(ids, [21, 9, 6, 0, 21, 10, 14, 6])  # 'a' is 2
    assert decode(ids) == "the time"
    assert encode("Q?")[0] == 1 and encode("Q?")[1] == 1  # not preprocessed: <unk>


def test_shipped_corpus_matches_the_book():
    data = TimeMachine()
    # d2l (section 9.2) reports 173428 characters and a 28-symbol vocabulary.
    assert data.corpus.shape == (173428,) and data.vocab_size == 28
    assert decode(data.corpus[:30]) == "the time machine by h g wells "


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("abcdefghijklmnopqrstuvwxyz" * 2)
    return TimeMachine(seq_len=4, num_train=10, num_val=5, path=path)


def windows_reference(ids, starts, n):
    win = np.stack([ids[s : s + n + 1] for s in starts])
    return win[:, :-1], win[:, 1:]


def test_windows_are_inputs_and_shifted_targets(small):
    ids = np.arange(52) % 26 + 2
    X, Y = small.windows(jnp.array([0, 7, 47]))
    ref_x, ref_y = windows_reference(ids, [0, 7, 47], 4)
    np.testing.assert_array_equal(X, ref_x)
    np.testing.assert_array_equal(Y, ref_y)


def test_validation_set_is_the_next_windows(small):
    X, Y = small.val_batch()
    ref_x, ref_y = windows_reference(np.arange(52) % 26 + 2, range(10, 15), 4)
    np.testing.assert_array_equal(X, ref_x)
    np.testing.assert_array_equal(Y, ref_y)


def test_train_batches_come_from_training_windows_and_are_keyed(small):
    batch = jax.jit(lambda k: small.train_batch(k, 64))
    X, Y = batch(jax.random.key(0))
    # the corpus is a..z twice, so a window's first letter gives its start (mod 26)
    starts = np.asarray(X[:, 0]) - 2
    assert starts.min() >= 0 and starts.max() < 10
    assert len(set(starts.tolist())) > 5  # 64 draws from 10 windows
    ref_x, ref_y = windows_reference(np.arange(52) % 26 + 2, starts, 4)
    np.testing.assert_array_equal(X, ref_x)
    np.testing.assert_array_equal(Y, ref_y)
    np.testing.assert_array_equal(batch(jax.random.key(0))[0], X)
    assert not np.array_equal(batch(jax.random.key(1))[0], X)
    # vmap over keys: one batch per key, as drawn one at a time
    Xs, _ = jax.vmap(lambda k: small.train_batch(k, 64))(
        jnp.stack([jax.random.key(0), jax.random.key(1)])
    )
    np.testing.assert_array_equal(Xs[0], X)


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="corpus file not found"):
        TimeMachine(path=tmp_path / "nope.txt")


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("123 -- 456\n")
    with pytest.raises(ValueError, match="is empty"):
        TimeMachine(seq_len=2, num_train=1, num_val=0, path=path)


def test_unreadable_file(tmp_path):
    path = tmp_path / "binary.txt"
    path.write_bytes(b"\xff\xfe\x00abc")
    with pytest.raises(ValueError, match="cannot read corpus file"):
        TimeMachine(path=path)
    with pytest.raises(ValueError, match="cannot read corpus file"):
        TimeMachine(path=tmp_path)  # a folder


def test_too_short_and_bad_sizes(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("abcdefghij")
    with pytest.raises(ValueError, match="fewer than num_train \\+ num_val = 8"):
        TimeMachine(seq_len=4, num_train=5, num_val=3, path=path)
    with pytest.raises(ConfigError, match="seq_len must lie in \\[1, inf\\], got 0"):
        TimeMachine(seq_len=0, path=path)
    with pytest.raises(ConfigError, match="num_val must lie in \\[0, inf\\], got -1"):
        TimeMachine(seq_len=2, num_train=1, num_val=-1, path=path)


def test_token_dataset_from_text_has_its_own_sorted_vocabulary():
    text = "Hello, World! 123"
    data = TokenDataset.from_text(text, 4, num_val=2)
    assert data.vocab == tuple(sorted(set(text)))  # nothing dropped or lowered
    assert data.vocab_size == len(set(text))
    assert data.decode(data.corpus) == text
    np.testing.assert_array_equal(
        data.encode("lo"), [data.vocab.index(c) for c in "lo"]
    )
    # len 17, windows of 5: 13 windows, the last 2 validate
    assert (data.num_train, data.num_val) == (11, 2)
    with pytest.raises(ValueError, match=r"not in the vocabulary: \['z'\]"):
        data.encode("z")


def test_token_dataset_windows_and_batches_match_numpy():
    ids = (np.arange(40) * 7) % 11  # any pre-tokenized sequence
    data = TokenDataset(ids, 5, num_train=30, num_val=5)
    assert data.vocab_size == 11 and data.vocab is None
    X, Y = data.windows(jnp.array([0, 3, 34]))
    ref_x, ref_y = windows_reference(ids, [0, 3, 34], 5)
    np.testing.assert_array_equal(X, ref_x)
    np.testing.assert_array_equal(Y, ref_y)
    Xv, Yv = data.val_batch()
    ref_x, ref_y = windows_reference(ids, range(30, 35), 5)
    np.testing.assert_array_equal(Xv, ref_x)
    np.testing.assert_array_equal(Yv, ref_y)
    Xb, Yb = jax.jit(lambda k: data.train_batch(k, 32))(jax.random.key(0))
    starts = [int(np.flatnonzero(np.all(np.lib.stride_tricks.sliding_window_view(
        ids, 5) == row, axis=1))[0]) for row in np.asarray(Xb)]  # fmt: skip
    assert max(starts) < 30  # training windows only
    np.testing.assert_array_equal(Yb[:, :-1], Xb[:, 1:])


@pytest.mark.parametrize(
    ("tokens", "kw", "match"),
    [
        (np.array([0, 1, -1, 2] * 3), {}, r"ids must lie in \[0, vocab_size=3\)"),
        (np.arange(12), {"vocab_size": 5}, r"ids must lie in \[0, vocab_size=5\)"),
        (np.arange(4), {}, "4 tokens give 0 windows"),
        (np.arange(20), {"num_train": 0}, r"num_train must lie in \[1, inf\]"),
        (np.arange(20), {"num_val": -1}, r"num_val must lie in \[0, inf\]"),
        (np.arange(20), {"num_train": 14, "num_val": 3}, "fewer than num_train"),
    ],
)
def test_token_dataset_refuses_bad_input(tokens, kw, match):
    with pytest.raises(ValueError, match=match):
        TokenDataset(tokens, 4, **kw)


def test_token_dataset_refuses_duplicate_symbols():
    with pytest.raises(ConfigError, match=r"distinct symbols, got 'a' at ids 0 and 1"):
        TokenDataset(np.array([0, 1, 2] * 4), 4, vocab=("a", "a", "b"))


@pytest.mark.parametrize(
    "tokens",
    [np.zeros((2, 8), np.int32), np.linspace(0, 1, 9), np.array([True, False] * 5)],
)
def test_token_dataset_refuses_tokens_that_are_not_1d_integer_ids(tokens):
    # A TypeError naming tokens (under the suite's type-checking hook, its own;
    # without it, "tokens must be 1-D" / "must be integer token ids").
    with pytest.raises(TypeError, match="tokens"):
        TokenDataset(tokens, 4)
