r"""Incremental detokenization: the text of a growing list of ids, piece by piece.

A tokenizer decodes a whole list of ids at once, and the text of ids $a$
followed by ids $b$ is not always the text of $a$ followed by that of $b$:

- a character of several UTF-8 bytes may span several tokens (byte-level BPE
  writes bytes; a byte-fallback tokenizer writes `<0xF0>` ... `<0x80>`), and
  until its last byte arrives the decoded text ends in U+FFFD;
- a byte-fallback decoder (`tokenizers`' `ByteFallback`) decodes a run of
  byte tokens as a whole: valid UTF-8, or one U+FFFD per byte, so a byte
  that makes the run invalid turns the characters before it in the run into
  U+FFFD too;
- a sentencepiece-style decoder drops the leading space of the first token
  it decodes (`▁Hello` alone is `Hello`), so a token decoded on its own loses
  the space it has after the ids before it;
- `clean_up_tokenization_spaces` (`transformers`' rule for some tokenizers)
  removes a space before punctuation, so `"a "` followed by `"."` is `"a."`.

`IncrementalDecoder` decodes a short window of the last ids (never one token
alone), emits the part of the window's text that no later token can change,
and holds the rest back: a trailing U+FFFD (an incomplete character), the
text of a trailing run of byte tokens (`<0x..>` ids of the tokenizer; until
a token that is not a byte ends the run) and, where the tokenizer cleans up
spaces, a trailing `" "`, `" '"` or `" n"` that a later token could make
into a pattern it rewrites. The pieces it
returns, joined, are the text of all the ids after the context (the method of
text-generation-inference's `decode_token`, with the hold-back made exact).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from .._validate import ConfigError

__all__ = ["IncrementalDecoder"]

#: What `transformers`' `clean_up_tokenization` rewrites (a space removed
#: before each); a text ending in a proper prefix of one is held back.
_CLEAN_UP = (" .", " ?", " !", " ,", " ' ", " n't", " 'm", " 's", " 've", " 're")
_HELD_SUFFIXES = sorted(
    {p[:i] for p in _CLEAN_UP for i in range(1, len(p))}, key=len, reverse=True
)

#: Context ids decoded before the first new one (more if they start inside a
#: character): enough for a leading space and a partial character.
_CONTEXT = 4


class IncrementalDecoder:
    r"""The text of ids that arrive one (or a few) at a time, as stable pieces.

    With $c$ the context ids (a prompt) and $n_1 \ldots n_t$ the ids pushed so
    far, the pieces returned by `push` and then `flush` join to
    $\mathrm{decode}(c' n_1 \ldots n_t)$ minus its first
    $|\mathrm{decode}(c')|$ characters, where $c'$ is the tail of $c$ (its
    last few ids): the text the new ids add after the context, as
    `tokenizer.decode` of all the ids writes it. No piece ends inside a
    character that a later token completes: a trailing U+FFFD is held back
    until the next id completes the character (or `flush` writes it, if none
    does); with byte fallback, a run of byte tokens comes out when it ends.
    (If the new ids extend a run of byte tokens that ends the context, and
    make it invalid, the context's own text changes: no piece can undo that.)

    Each `push` decodes a window of ids (from the last point where all the
    text had been emitted), so its cost does not grow with the text.

    Args:
        tokenizer: anything with `decode(list[int]) -> str`.
        context: the ids before the first pushed one (the prompt), or empty.
    """

    def __init__(self, tokenizer: Any, context: Sequence[int] | np.ndarray = ()):
        if not callable(getattr(tokenizer, "decode", None)):
            raise ConfigError(
                "IncrementalDecoder: tokenizer must have a decode(ids) -> str "
                f"method, got {type(tokenizer).__name__}."
            )
        self._tokenizer = tokenizer
        self._bytes = _byte_ids(tokenizer)
        # the rule of blocklab's Tokenizer (private) or transformers' (public)
        self._clean_up = bool(
            getattr(tokenizer, "_clean_up_spaces", False) is True
            or getattr(tokenizer, "clean_up_tokenization_spaces", False) is True
        )
        ids = [int(i) for i in np.asarray(context, dtype=np.int64).reshape(-1)]
        start = max(len(ids) - _CONTEXT, 0)
        # a window that starts inside a character would decode its first bytes
        # as U+FFFD: start it a little earlier, at a character's first byte
        while start > 0 and start > len(ids) - 4 * _CONTEXT:
            if not self._decode(ids[start:]).startswith("\ufffd"):
                break
            start -= 1
        self._ids = ids[start:]
        text = self._decode(self._ids)
        self._start = 0  # the window: ids[_start:]
        # all the text of ids[_start:_read] is out, and _read is at a
        # character's first byte: a window never starts inside a character
        # (a byte-fallback decoder writes a whole run of bytes as U+FFFD if
        # the run does not start with a first byte)
        self._read = 0 if text.endswith("\ufffd") else len(self._ids)
        self._sent = len(text)  # characters of the window's text out

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids)

    def push(self, ids: int | Iterable[int]) -> str:
        """Add the next id (or ids); return the new text that is stable now
        (possibly `""`)."""
        new = [ids] if isinstance(ids, (int, np.integer)) else list(ids)
        self._ids.extend(int(i) for i in new)
        window = self._ids[self._start :]
        text = self._decode(window)
        run = 0  # the trailing run of byte tokens: its text may still change
        while run < len(window) and window[-1 - run] in self._bytes:
            run += 1
        stable = self._stable(self._decode(window[:-run]) if run else text)
        if len(stable) <= self._sent:
            return ""
        piece = stable[self._sent :]
        if len(stable) == len(text) and not run:  # all out: start at _read
            self._start, self._read = self._read, len(self._ids)
            self._sent = len(self._decode(self._ids[self._start : self._read]))
        else:
            self._sent = len(stable)
        return piece

    def flush(self) -> str:
        """The text held back (an incomplete character, a trailing space):
        call it once the ids end."""
        text = self._decode(self._ids[self._start :])
        piece = text[self._sent :]
        self._start, self._read = len(self._ids), len(self._ids)
        self._sent = 0
        return piece

    def _stable(self, text: str) -> str:
        """`text` without the suffix that a later id could still change."""
        stable = text.rstrip("\ufffd")
        if self._clean_up:
            for suffix in _HELD_SUFFIXES:
                if stable.endswith(suffix):
                    return stable[: -len(suffix)]
        return stable


def _byte_ids(tokenizer: Any) -> frozenset[int]:
    """The ids of the byte tokens `<0x00>` ... `<0xFF>` of a byte-fallback
    tokenizer (blocklab's `Tokenizer` or a `transformers` fast tokenizer);
    empty for any other."""
    backend = getattr(tokenizer, "_backend", None)
    backend = getattr(tokenizer, "backend_tokenizer", backend)
    if not callable(getattr(backend, "token_to_id", None)):
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)
