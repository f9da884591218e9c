"""Checks shared by the text functions (`evaluate_text`, `generate_text`): a
list of texts, and the ids a tokenizer gave."""

from __future__ import annotations

from typing import Any

import numpy as np

from .._validate import ConfigError


def check_text_list(owner: str, name: str, texts: Any) -> list[str]:
    """`texts` (a non-empty list or tuple of str) as a list, or `ConfigError`
    naming `owner`, `name` (or `name[i]`, the first entry that is not a str)
    and what came. A caller that also takes one str wraps it in a list first
    (the message names both forms)."""
    if not isinstance(texts, (list, tuple)) or not texts:
        raise ConfigError(
            f"{owner}: {name} must be a non-empty str or a non-empty list of str, "
            f"got {texts!r:.60} of type {type(texts).__name__}."
        )
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise ConfigError(
                f"{owner}: {name}[{i}] must be a str, got {text!r:.60} of type "
                f"{type(text).__name__}."
            )
    return list(texts)


def check_ids_in_vocab(
    owner: str, call: str, ids: np.ndarray, vocab: int
) -> np.ndarray:
    """`ids` (what `call` gave, 1-D ints) as int32 when every id lies in
    `[0, vocab)`, else `ConfigError` naming `call`, the first id outside and
    its index."""
    outside = (ids < 0) | (ids >= vocab)
    if outside.any():
        i = int(np.argmax(outside))
        raise ConfigError(
            f"{owner}: {call} gave token id {int(ids[i])} at index {i}, outside "
            f"the model's vocabulary [0, vocab_size={vocab}); use the tokenizer "
            "the model was trained with."
        )
    return ids.astype(np.int32)
