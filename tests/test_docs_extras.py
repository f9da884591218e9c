"""Documented code that needs an optional package says so, and an install
extra provides it (issue 37, item 5).

Every fenced Python block (```python or ```py) of the README and the docs
pages that imports `torch`, `transformers`, `peft` or `lm_eval` names them on
its first line (`# needs: ...`, the marker tests/test_docs.py reads) and, on
the next, the extra that installs them (`# pip install "blocklab[EXTRA]"`);
that extra, in pyproject.toml, lists every one of them.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(
    p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").rglob("*.md")
)]  # fmt: skip

#: Import name -> distribution name, for the optional packages.
OPTIONAL = {"torch": "torch", "transformers": "transformers", "peft": "peft",
            "lm_eval": "lm-eval"}  # fmt: skip

_BLOCK = re.compile(r"^```(?:python|py)[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.M)
_NEEDS = re.compile(r"\A#\s*needs:\s*(.+?)\s*$", re.M)
_EXTRA = re.compile(r'\A[^\n]*\n#\s*pip install "blocklab\[([\w-]+)\]"\s*$', re.M)


def _extras() -> dict[str, set[str]]:
    tomllib = pytest.importorskip("tomllib")
    data = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    return {
        name: {re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0].lower() for req in reqs}
        for name, reqs in data["project"]["optional-dependencies"].items()
    }


def optional_imports(source: str) -> set[str]:
    return {m for m in _IMPORT.findall(source) if m in OPTIONAL}


def blocks_needing_packages():
    out = []
    for page in PAGES:
        text = (ROOT / page).read_text(encoding="utf-8")
        for m in _BLOCK.finditer(text):
            used = optional_imports(m.group(1))
            if used:
                line = text.count("\n", 0, m.start(1)) + 1
                out.append(pytest.param(m.group(1), used, id=f"{page}:{line}"))
    return out


BLOCKS = blocks_needing_packages()


def test_the_docs_have_such_blocks():
    assert len(BLOCKS) >= 3  # interop: transformers, torch; lm-eval


@pytest.mark.parametrize("source,used", BLOCKS)
def test_a_block_names_what_it_needs_and_an_extra_that_installs_it(source, used):
    needs = _NEEDS.match(source)
    assert needs, f"first line should be '# needs: {', '.join(sorted(used))}'"
    named = {n.strip() for n in needs.group(1).split(",")}
    assert used <= named, f"imports {sorted(used)}, says it needs {sorted(named)}"
    extra = _EXTRA.match(source)
    assert extra, "second line should be '# pip install \"blocklab[EXTRA]\"'"
    extras = _extras()
    assert extra.group(1) in extras, f"no extra {extra.group(1)!r} in pyproject.toml"
    provided = extras[extra.group(1)]
    missing = {OPTIONAL[u] for u in used} - provided
    assert not missing, f"blocklab[{extra.group(1)}] does not install {missing}"


def test_the_parsers_on_hand_written_blocks():
    good = '# needs: torch, transformers\n# pip install "blocklab[hf]"\nimport torch\n'
    assert optional_imports(good) == {"torch"}
    assert _NEEDS.match(good).group(1) == "torch, transformers"
    assert _EXTRA.match(good).group(1) == "hf"
    assert optional_imports("import jax\nfrom transformers import X\n") == {
        "transformers"
    }
    assert _EXTRA.match("# needs: torch\nimport torch\n") is None
