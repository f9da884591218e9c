"""Checks shared by the text functions (`evaluate_text`, `generate_text`)."""

from __future__ import annotations

from typing import Any

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
