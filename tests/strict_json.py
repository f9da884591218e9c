"""Strict JSON for the tests: what a strict parser accepts, no NaN or Infinity.

Python's `json.loads` reads the non-standard `NaN`, `Infinity` and
`-Infinity` that `json.dumps` writes by default; strict parsers (browsers',
`jq`'s) refuse them. Every JSON blocklab writes (the CLI's `--json`, the
studies' `to_json()`) must parse here.

This module is a helper imported by the tests, not a test file.
"""

from __future__ import annotations

import json


def strict_loads(text):
    """`json.loads` that refuses NaN / Infinity."""

    def refuse(constant):
        raise ValueError(f"non-strict JSON constant {constant}")

    return json.loads(text, parse_constant=refuse)


def strict_object(text):
    """One strict JSON object (a dict), as the CLI prints on every exit path."""
    obj = strict_loads(text)
    assert isinstance(obj, dict), obj
    return obj


def strict_round_trip(obj):
    """`obj` written as strict JSON (refusing NaN) and read back."""
    return strict_loads(json.dumps(obj, allow_nan=False))
