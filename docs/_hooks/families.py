"""A mkdocs hook: the checkpoint families table, generated from the registry.

A page writes `{{ families_table }}` (or `{{ families_count }}`, ...) where
the table of registered families goes; the build puts in what
`blocklab.interop` registers at that moment, so the page cannot fall behind
the code. `registered()` is the one place that reads the registry.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One registered family, as the docs show it."""

    name: str
    kind: str  # "decoder", "encoder" or "encoder–decoder"
    classes: tuple[str, ...]
    model_types: tuple[str, ...]
    variant_of: str | None = None


def registered() -> list[Family]:
    """Every family `blocklab.interop` registers, decoders first, by name."""
    import blocklab  # noqa: F401  (importing blocklab registers every family)
    from blocklab.interop import FAMILIES

    families = [
        Family(
            f.name,
            "decoder" if f.layered else _encoder_kind(f.classes),
            tuple(f.classes),
            tuple(f.model_types),
            f.variant_of,
        )
        for f in FAMILIES.values()
    ]
    by_name = lambda f: f.name  # noqa: E731
    decoders = sorted((f for f in families if f.kind == "decoder"), key=by_name)
    return decoders + sorted((f for f in families if f.kind != "decoder"), key=by_name)


def _encoder_kind(classes) -> str:
    """`transformers` names its seq2seq models `...ForConditionalGeneration`."""
    seq2seq = any(c.endswith("ForConditionalGeneration") for c in classes)
    return "encoder–decoder" if seq2seq else "encoder"


def _codes(names) -> str:
    return ", ".join(f"`{n}`" for n in names)


def table(families: list[Family]) -> str:
    """The families as a Markdown table: name, kind, classes, model types."""
    rows = [
        "| family (`family=`) | kind | `transformers` classes | `model_type` |",
        "|---|---|---|---|",
    ]
    for f in families:
        kind = f.kind
        if f.variant_of is not None:
            kind += f", generalizes `{f.variant_of}`"
        rows.append(
            f"| `{f.name}` | {kind} | {_codes(f.classes)} | {_codes(f.model_types)} |"
        )
    return "\n".join(rows)


def placeholders(families: list[Family]) -> dict[str, str]:
    """What each `{{ name }}` of a page becomes."""
    decoders = [f for f in families if f.kind == "decoder"]
    seq2seq = [f for f in families if f.kind == "encoder–decoder"]
    return {
        "families_table": table(families),
        "families_count": str(len(families)),
        "decoder_families_count": str(len(decoders)),
        "encoder_families_count": str(len(families) - len(decoders)),
        "seq2seq_families_count": str(len(seq2seq)),
        "classes_count": str(sum(len(f.classes) for f in families)),
    }


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001
    """mkdocs: put the generated text in place of each `{{ name }}`."""
    if "{{" not in markdown:
        return markdown
    for name, text in placeholders(registered()).items():
        markdown = markdown.replace("{{ " + name + " }}", text)
    return markdown
