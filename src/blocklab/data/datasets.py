"""The character-level Time Machine corpus, as device arrays and on-device batches.

`TokenDataset` is the same windowing over any token sequence: a text with
its own character vocabulary (`TokenDataset.from_text`) or a pre-tokenized
integer array. Both are batch sources for `blocklab.training.step` (they have
`train_batch(key, batch_size)` and `val_batch()`).

The text (H. G. Wells, 1898) ships with the package (`blocklab/data/
timemachine.txt`); nothing downloads. Preprocessing follows
`d2l.TimeMachine(tokenization='char')`: every run of characters other than
ASCII letters becomes one space, the text is lower-cased and split into
characters. The vocabulary is the sorted set of the 26 letters, the space and
`<unk>` (28 symbols): index 0 is the space, 1 is `<unk>`, 2..27 are `a`..`z`.

A `TimeMachine` is an Equinox module whose only array is the encoded corpus,
so it can be passed through `jax.jit` / `jax.vmap` and its batches are drawn on
the device from a PRNG key (no host work per step).
"""

from __future__ import annotations

import importlib.resources
import re
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, ArrayLike, Int, PRNGKeyArray

from .._validate import ConfigError, check_int

__all__ = [
    "TimeMachine",
    "TokenDataset",
    "VOCAB",
    "preprocess",
    "encode",
    "decode",
    "corpus_path",
    "pack_documents",
]


class _CharVocab(tuple):
    """The character vocabulary of the corpus: a tuple of symbols (token id `i` is
    `vocab[i]`) that is also a tokenizer, with `encode` and `decode`
    (`blocklab.generate_text(model, VOCAB, prompt, n)`)."""

    __slots__ = ()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` normalized as the corpus is: `preprocess` (runs
        of non-letters to one space, lower case), then `encode`; so
        `decode(encode(text)) == preprocess(text)`."""
        if not isinstance(text, str):
            raise ConfigError(
                f"VOCAB.encode: text must be a str, got {type(text).__name__}."
            )
        return encode(preprocess(text)).tolist()

    def decode(self, ids) -> str:
        """Text of token ids (the module's `decode`)."""
        return decode(ids)


#: The 28 symbols, in the order of d2l's `Vocab` (sorted): space, `<unk>`, a..z.
#: A tuple, and a tokenizer (`encode`, `decode`) for a character-level `CharLM`.
VOCAB: tuple[str, ...] = _CharVocab((" ", "<unk>", *"abcdefghijklmnopqrstuvwxyz"))
_UNK = VOCAB.index("<unk>")
_INDEX = {tok: i for i, tok in enumerate(VOCAB)}


def corpus_path() -> Path:
    """Path of the shipped corpus file (package data)."""
    return Path(str(importlib.resources.files("blocklab") / "data" / "timemachine.txt"))


def preprocess(text: str) -> str:
    """Every run of non-letters becomes one space; then lower case."""
    return re.sub("[^A-Za-z]+", " ", text).lower()


def encode(text: str) -> np.ndarray:
    """Token ids (int32) of the characters of `text`; unknown characters map to `<unk>`.

    `text` is taken as is: call `preprocess` first for raw text.
    """
    return np.array([_INDEX.get(c, _UNK) for c in text], dtype=np.int32)


def decode(ids) -> str:
    """Text of a sequence of token ids (`<unk>` is written out as `<unk>`)."""
    return "".join(VOCAB[int(i)] for i in np.asarray(ids).reshape(-1))


def _read_corpus(path: Path) -> str:
    try:
        raw = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(
            f"TimeMachine: corpus file not found: {path}. The corpus ships with "
            "the package (blocklab/data/timemachine.txt); reinstall blocklab or "
            "pass path= to an existing text file."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(
            f"TimeMachine: cannot read corpus file path={path}: {err}"
        ) from err
    return raw


class _Windowed(eqx.Module):
    """A token corpus cut into windows of `seq_len + 1` tokens (the shared
    machinery of `TimeMachine` and `TokenDataset`)."""

    corpus: Int[Array, " L"]
    seq_len: int = eqx.field(static=True)
    num_train: int = eqx.field(static=True)
    num_val: int = eqx.field(static=True)

    def windows(
        self, starts: Int[Array, " B"]
    ) -> tuple[Int[Array, "B seq_len"], Int[Array, "B seq_len"]]:
        """Inputs and targets `(X, Y)` of the windows starting at `starts`."""
        n = self.seq_len + 1
        win = jax.vmap(lambda s: jax.lax.dynamic_slice(self.corpus, (s,), (n,)))(starts)
        return win[:, :-1], win[:, 1:]

    def train_batch(
        self, key: PRNGKeyArray, batch_size: int
    ) -> tuple[Int[Array, "B seq_len"], Int[Array, "B seq_len"]]:
        """`batch_size` training windows, uniform with replacement, from `key`."""
        batch_size = check_int(
            f"{type(self).__name__}.train_batch", "batch_size", batch_size, min=1
        )
        starts = jax.random.randint(key, (batch_size,), 0, self.num_train)
        return self.windows(starts)

    def val_batch(self) -> tuple[Int[Array, "V seq_len"], Int[Array, "V seq_len"]]:
        """The `num_val` validation windows, in order (always the same)."""
        return self.windows(jnp.arange(self.num_train, self.num_train + self.num_val))


class TimeMachine(_Windowed):
    r"""The character-level Time Machine, windowed for next-character prediction.

    With the encoded corpus $c_0, c_1, \ldots$, window $i$ is
    $(c_i, \ldots, c_{i+n})$ of `seq_len + 1` = $n + 1$ characters: its first
    $n$ are the input $X_i$ and its last $n$ the target $Y_i$. Windows
    $0 \ldots$ `num_train - 1` train; the next `num_val` validate (they overlap
    the last training windows by up to $n$ characters, as d2l's split does).

    Training batches are drawn uniformly with replacement from the training
    windows by `train_batch(key, batch_size)`, a pure function that runs
    under `jit`/`vmap`/`scan`. (d2l's loader shuffles without
    replacement; at 600 steps of 64 out of 100000 windows the two hardly
    differ.) `val_batch()` is the fixed validation set.

    Attributes:
        corpus: `(L,)` int32 token ids of the whole preprocessed text.
        seq_len, num_train, num_val: window length and split sizes.
    """

    def __init__(
        self,
        seq_len: int = 128,
        num_train: int = 100000,
        num_val: int = 3000,
        *,
        path: str | Path | None = None,
    ):
        """Args:
        seq_len: characters per input sequence $n$ (windows have $n + 1$).
        num_train: number of training windows (the first ones).
        num_val: number of validation windows (the next ones).
        path: a text file to use instead of the shipped corpus.

        Raises:
            ConfigError: a non-positive size, a missing, unreadable or empty
                corpus, or a corpus too short for `num_train + num_val` windows.
        """
        owner = "TimeMachine"
        seq_len = check_int(owner, "seq_len", seq_len, min=1)
        num_train = check_int(owner, "num_train", num_train, min=1)
        num_val = check_int(owner, "num_val", num_val, min=0)
        path = corpus_path() if path is None else Path(path)
        text = preprocess(_read_corpus(path))
        if not text.strip():
            raise ConfigError(
                f"TimeMachine: corpus file path={path} is empty (no letters after "
                "preprocessing)."
            )
        ids = encode(text)
        num_windows = len(ids) - seq_len
        if num_train + num_val > num_windows:
            raise ConfigError(
                f"TimeMachine: the corpus ({len(ids)} characters) has "
                f"{max(num_windows, 0)} windows of seq_len + 1 = {seq_len + 1}, "
                f"fewer than num_train + num_val = {num_train + num_val}; lower them."
            )
        self.seq_len, self.num_train, self.num_val = seq_len, num_train, num_val
        self.corpus = jnp.asarray(ids, dtype=jnp.int32)

    @property
    def vocab(self) -> tuple[str, ...]:
        """The 28 symbols; token id `i` is `vocab[i]`."""
        return VOCAB

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)


def pack_documents(
    documents, seq_len: int, *, pad_id: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    r"""Pack token documents into fixed windows with their segment ids.

    The documents are laid end to end (in order) into one stream
    $c_0, c_1, \ldots$ with the document index of every token, and cut into
    windows of $n + 1$ tokens ($n$ = `seq_len`) with stride $n$, as
    `TokenDataset` cuts its windows: window $i$ is $c_{in}, \ldots,
    c_{in+n}$, so every token but the first is a target exactly once. A
    document longer than the room left continues in the next window (its
    positions restart there). Segment ids are renumbered from 0 in each
    window; the tail of the last window is `pad_id` with segment id -1.

    Use: `X, Y = w[:, :-1], w[:, 1:]`, `lm_loss(model, X, Y, segment_ids=s)`
    (the whole-window ids tell which targets lie in their input's document).

    Args:
        documents: a sequence of 1-D integer token arrays (each non-empty).
        seq_len: input tokens per window $n \ge 1$.
        pad_id: the padding token id.

    Returns:
        `(windows, segment_ids)`, int32 arrays of shape `(N, seq_len + 1)`.
    """
    owner = "pack_documents"
    seq_len = check_int(owner, "seq_len", seq_len, min=1)
    pad_id = check_int(owner, "pad_id", pad_id, min=0)
    if (
        isinstance(documents, np.ndarray)
        and documents.ndim != 1
        or isinstance(documents, (str, bytes))
    ):
        raise ConfigError(
            f"{owner}: documents must be a list of 1-D token arrays, got "
            f"{type(documents).__name__}."
        )
    docs = []
    for i, doc in enumerate(documents):
        d = np.asarray(doc)
        if d.ndim != 1 or d.size == 0 or not np.issubdtype(d.dtype, np.integer):
            raise ConfigError(
                f"{owner}: documents[{i}] must be a non-empty 1-D integer array, "
                f"got dtype {d.dtype}, shape {d.shape}."
            )
        bad = (d < 0) | (d > np.iinfo(np.int32).max)
        if bad.any():
            j = int(np.argmax(bad))
            raise ConfigError(
                f"{owner}: documents[{i}][{j}] = {int(d[j])} is not a token id: ids "
                f"are integers in [0, {np.iinfo(np.int32).max}] (stored as int32)."
            )
        docs.append(d)
    if not docs:
        raise ConfigError(f"{owner}: documents is empty; pass at least one.")
    stream = np.concatenate(docs).astype(np.int32)
    seg = np.concatenate([np.full(len(d), i, np.int32) for i, d in enumerate(docs)])
    n = seq_len
    num = max(1, -(-(len(stream) - 1) // n))
    total = num * n + 1
    stream = np.concatenate([stream, np.full(total - len(stream), pad_id, np.int32)])
    seg = np.concatenate([seg, np.full(total - len(seg), -1, np.int32)])
    idx = np.arange(num)[:, None] * n + np.arange(n + 1)
    windows, segments = stream[idx], seg[idx]
    first = np.where(segments >= 0, segments, np.iinfo(np.int32).max).min(axis=1)
    segments = np.where(segments >= 0, segments - first[:, None], -1)
    return windows, segments.astype(np.int32)


class TokenDataset(_Windowed):
    r"""Any token sequence, windowed for next-token prediction like `TimeMachine`.

    With tokens $c_0, c_1, \ldots, c_{L-1}$ and window length $n$ =
    `seq_len`, window $i$ is $(c_i, \ldots, c_{i+n})$: its first $n$ tokens
    are the input $X_i$, its last $n$ the target $Y_i$. Windows
    $0 \ldots$ `num_train - 1` train (drawn uniformly with replacement by
    `train_batch(key, batch_size)`, on the device); the next `num_val`
    validate (`val_batch()`, always the same). There are $L - n$ windows in
    all.

    Build it from a pre-tokenized array (`TokenDataset(tokens, seq_len,
    vocab_size=...)`) or from any text with its own character vocabulary
    (`TokenDataset.from_text(text, seq_len)`: the sorted set of the text's
    characters, nothing dropped or lower-cased).

    Attributes:
        corpus: `(L,)` int32 token ids.
        seq_len, num_train, num_val: window length and split sizes.
        vocab_size: token ids lie in `[0, vocab_size)`.
        vocab: the symbol of each id (text datasets), or `None`.
    """

    vocab_size: int = eqx.field(static=True)
    vocab: tuple[str, ...] | None = eqx.field(static=True)

    def __init__(
        self,
        tokens: Int[ArrayLike, " L"],
        seq_len: int | None = None,
        *,
        num_train: int | None = None,
        num_val: int = 0,
        vocab_size: int | None = None,
        vocab: tuple[str, ...] | None = None,
    ):
        """Args:
        tokens: a 1-D sequence of non-negative integer token ids.
        seq_len: tokens per input sequence $n$ (windows have $n + 1$).
        num_train: training windows (the first ones); default: every window
            not used for validation.
        num_val: validation windows (the ones after the training windows).
        vocab_size: default `max(tokens) + 1` (or `len(vocab)`).
        vocab: optional symbol of each id (used by `decode`).

        Raises:
            ConfigError: tokens that are not a 1-D integer array, an id outside
                `[0, vocab_size)`, bad sizes, or too few tokens for
                `num_train + num_val` windows.
        """
        owner = "TokenDataset"
        if seq_len is None:
            raise ConfigError(
                f"{owner}: seq_len (tokens per input sequence) is required, e.g. "
                "TokenDataset(tokens, seq_len=128)."
            )
        ids = np.asarray(tokens)
        if ids.dtype == bool or not np.issubdtype(ids.dtype, np.integer):
            raise ConfigError(
                f"{owner}: tokens must be integer token ids, got dtype {ids.dtype}; "
                "use TokenDataset.from_text for text."
            )
        if ids.ndim != 1:
            raise ConfigError(
                f"{owner}: tokens must be 1-D, got shape {ids.shape}; concatenate "
                "the documents into one sequence."
            )
        seq_len = check_int(owner, "seq_len", seq_len, min=1)
        num_val = check_int(owner, "num_val", num_val, min=0)
        if vocab is not None:
            vocab = tuple(str(v) for v in vocab)
            seen: dict[str, int] = {}
            for i, v in enumerate(vocab):
                if v in seen:
                    raise ConfigError(
                        f"{owner}: vocab must hold distinct symbols, got {v!r} at "
                        f"ids {seen[v]} and {i} (encode could not tell them apart)."
                    )
                seen[v] = i
        default_vocab = len(vocab) if vocab is not None else None
        if vocab_size is None:
            vocab_size = default_vocab or (int(ids.max()) + 1 if ids.size else 1)
        vocab_size = check_int(owner, "vocab_size", vocab_size, min=1)
        if vocab is not None and len(vocab) != vocab_size:
            raise ConfigError(
                f"{owner}: vocab has {len(vocab)} symbols but vocab_size={vocab_size}."
            )
        if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
            raise ConfigError(
                f"{owner}: token ids must lie in [0, vocab_size={vocab_size}), got "
                f"ids from {int(ids.min())} to {int(ids.max())}."
            )
        if vocab_size > np.iinfo(np.int32).max:
            raise ConfigError(f"{owner}: vocab_size={vocab_size} exceeds int32.")
        num_windows = max(ids.size - seq_len, 0)
        if num_train is not None:
            num_train = check_int(owner, "num_train", num_train, min=1)
        if (num_train or 1) + num_val > num_windows:
            raise ConfigError(
                f"{owner}: {ids.size} tokens give {num_windows} windows of "
                f"seq_len + 1 = {seq_len + 1}, fewer than num_train + num_val = "
                f"{(num_train or 1) + num_val} (at least one training window); give "
                "more tokens or lower them."
            )
        if num_train is None:
            num_train = num_windows - num_val
        self.corpus = jnp.asarray(ids, dtype=jnp.int32)
        self.seq_len, self.num_train, self.num_val = seq_len, num_train, num_val
        self.vocab_size, self.vocab = vocab_size, vocab

    #: `pack_documents`: documents into fixed windows with segment ids.
    pack_documents = staticmethod(pack_documents)

    @classmethod
    def from_text(
        cls,
        text: str,
        seq_len: int | None = None,
        *,
        num_train: int | None = None,
        num_val: int = 0,
    ) -> TokenDataset:
        """A character dataset of `text` with its own vocabulary (sorted characters).

        `seq_len` as for `TokenDataset`.
        """
        if not isinstance(text, str) or not text:
            raise ConfigError(
                "TokenDataset.from_text: text must be a non-empty str, got "
                f"{text!r:.40}."
            )
        vocab = tuple(sorted(set(text)))
        index = {c: i for i, c in enumerate(vocab)}
        ids = np.fromiter((index[c] for c in text), np.int32, len(text))
        return cls(ids, seq_len, num_train=num_train, num_val=num_val, vocab=vocab)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text` (text datasets only; every character must be known)."""
        if self.vocab is None:
            raise ConfigError("TokenDataset.encode: this dataset has no vocab.")
        index = {c: i for i, c in enumerate(self.vocab)}
        unknown = sorted(set(text) - set(index))
        if unknown:
            raise ConfigError(
                f"TokenDataset.encode: characters not in the vocabulary: {unknown}."
            )
        return np.array([index[c] for c in text], dtype=np.int32)

    def decode(self, ids) -> str:
        """Text of token ids (text datasets only)."""
        if self.vocab is None:
            raise ConfigError("TokenDataset.decode: this dataset has no vocab.")
        return "".join(self.vocab[int(i)] for i in np.asarray(ids).reshape(-1))
