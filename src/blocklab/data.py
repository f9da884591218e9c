"""The character-level Time Machine corpus, as device arrays and on-device batches.

The text (H. G. Wells, 1898) ships with the package (`blocklab/data/
timemachine.txt`); nothing downloads. Preprocessing follows the chapter's
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
from jaxtyping import Array, Int, PRNGKeyArray

__all__ = ["TimeMachine", "VOCAB", "preprocess", "encode", "decode", "corpus_path"]

#: The 28 symbols, in the order of d2l's `Vocab` (sorted): space, `<unk>`, a..z.
VOCAB: tuple[str, ...] = (" ", "<unk>", *"abcdefghijklmnopqrstuvwxyz")
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
        raise ValueError(
            f"TimeMachine: corpus file not found: {path}. The corpus ships with "
            "the package (blocklab/data/timemachine.txt); reinstall blocklab or "
            "pass path= to an existing text file."
        ) from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"TimeMachine: cannot read corpus file {path}: {err}") from err
    return raw


class TimeMachine(eqx.Module):
    r"""The character-level Time Machine, windowed for next-character prediction.

    With the encoded corpus $c_0, c_1, \ldots$, window $i$ is
    $(c_i, \ldots, c_{i+n})$ of `num_steps + 1` = $n + 1$ characters: its first
    $n$ are the input $X_i$ and its last $n$ the target $Y_i$. Windows
    $0 \ldots$ `num_train - 1` train; the next `num_val` validate (they overlap
    the last training windows by up to $n$ characters, as in the chapter).

    Training batches are drawn uniformly with replacement from the training
    windows by `train_batch(key, batch_size)`, a pure function that runs
    under `jit`/`vmap`/`scan`. (The chapter's loader shuffles without
    replacement; at 600 steps of 64 out of 100000 windows the two hardly
    differ.) `val_batch()` is the fixed validation set.

    Attributes:
        corpus: `(L,)` int32 token ids of the whole preprocessed text.
        num_steps, num_train, num_val: window length and split sizes.
    """

    corpus: Int[Array, " L"]
    num_steps: int = eqx.field(static=True)
    num_train: int = eqx.field(static=True)
    num_val: int = eqx.field(static=True)

    def __init__(
        self,
        num_steps: int = 128,
        num_train: int = 100000,
        num_val: int = 3000,
        *,
        path: str | Path | None = None,
    ):
        """Args:
        num_steps: characters per input sequence $n$ (windows have $n + 1$).
        num_train: number of training windows (the first ones).
        num_val: number of validation windows (the next ones).
        path: a text file to use instead of the shipped corpus.

        Raises:
            ValueError: a non-positive size, a missing, unreadable or empty
                corpus, or a corpus too short for `num_train + num_val` windows.
        """
        for name, value in (("num_steps", num_steps), ("num_train", num_train)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"TimeMachine: {name} must be a positive int, got {value!r}."
                )
        if not isinstance(num_val, int) or num_val < 0:
            raise ValueError(
                f"TimeMachine: num_val must be an int >= 0, got {num_val!r}."
            )
        path = corpus_path() if path is None else Path(path)
        text = preprocess(_read_corpus(path))
        if not text.strip():
            raise ValueError(
                f"TimeMachine: corpus file {path} is empty (no letters after "
                "preprocessing)."
            )
        ids = encode(text)
        num_windows = len(ids) - num_steps
        if num_train + num_val > num_windows:
            raise ValueError(
                f"TimeMachine: the corpus ({len(ids)} characters) has "
                f"{max(num_windows, 0)} windows of num_steps + 1 = {num_steps + 1}, "
                f"fewer than num_train + num_val = {num_train + num_val}; lower them."
            )
        self.num_steps, self.num_train, self.num_val = num_steps, num_train, num_val
        self.corpus = jnp.asarray(ids, dtype=jnp.int32)

    @property
    def vocab(self) -> tuple[str, ...]:
        """The 28 symbols; token id `i` is `vocab[i]`."""
        return VOCAB

    @property
    def vocab_size(self) -> int:
        return len(VOCAB)

    def windows(
        self, starts: Int[Array, " B"]
    ) -> tuple[Int[Array, "B num_steps"], Int[Array, "B num_steps"]]:
        """Inputs and targets `(X, Y)` of the windows starting at `starts`."""
        n = self.num_steps + 1
        win = jax.vmap(lambda s: jax.lax.dynamic_slice(self.corpus, (s,), (n,)))(starts)
        return win[:, :-1], win[:, 1:]

    def train_batch(
        self, key: PRNGKeyArray, batch_size: int
    ) -> tuple[Int[Array, "B num_steps"], Int[Array, "B num_steps"]]:
        """`batch_size` training windows, uniform with replacement, from `key`."""
        starts = jax.random.randint(key, (batch_size,), 0, self.num_train)
        return self.windows(starts)

    def val_batch(self) -> tuple[Int[Array, "V num_steps"], Int[Array, "V num_steps"]]:
        """The `num_val` validation windows, in order (always the same)."""
        return self.windows(jnp.arange(self.num_train, self.num_train + self.num_val))
