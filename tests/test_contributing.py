"""The maintainers' page runs: each recipe of docs/contributing.md, applied.

Each recipe (a `## ` section of the page) is a list of titled code blocks:
a block titled with a path under `src/` is an edit of that file (`# after:
LINE`: inserted after the one line that reads LINE; `# replaces: LINE`: in
its place; neither: a new file), and a block titled `check.py` is run
afterwards. Here every recipe's edits go into a fresh copy of the package
(as `tests/test_block_config.py::test_a_new_option_needs_one_edit` does), and
its checks run in a fresh interpreter with that copy first on the path: a
recipe whose anchor line has moved, or whose check no longer holds, fails.

Applying the edits takes milliseconds and is in the default run (an anchor
line that moved fails at once); running the checks compiles small programs
for seconds to a minute per recipe, so it is in the slow set, as the docs'
own page runs are (`tests/test_docs.py`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "contributing.md"

#: A titled Python block: ```python title="PATH" ... ```.
_BLOCK = re.compile(r'^```python title="([^"]+)"[ \t]*\n(.*?)^```[ \t]*$', re.S | re.M)

#: The first line of an edit: `# after: LINE` or `# replaces: LINE`.
_ANCHOR = re.compile(r"\A[ \t]*# (after|replaces): (.+?)[ \t]*\n")


def recipes(markdown: str) -> dict[str, list[tuple[str, str]]]:
    """`## ` heading -> the (title, source) of its titled Python blocks."""
    found: dict[str, list[tuple[str, str]]] = {}
    for part in re.split(r"^## ", markdown, flags=re.M)[1:]:
        heading = part.split("\n", 1)[0].strip()
        found[heading] = _BLOCK.findall(part)
    return found


def apply_edit(package: Path, title: str, source: str) -> None:
    """Apply one edit block (titled `src/blocklab/...`) to the copy `package`."""
    assert title.startswith("src/blocklab/"), title
    path = package / title.removeprefix("src/blocklab/")
    anchor = _ANCHOR.match(source)
    if anchor is None:  # a new file
        assert not path.exists(), f"{title} exists: a new file must be new"
        path.write_text(source, encoding="utf-8")
        return
    how, line = anchor.groups()
    body = source[anchor.end() :]
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    at = [i for i, text in enumerate(lines) if text.strip() == line]
    assert len(at) == 1, f"{title}: {len(at)} lines read {line!r}, not one"
    i = at[0]
    lines[i : i + 1] = [lines[i], body] if how == "after" else [body]
    path.write_text("".join(lines), encoding="utf-8")


def edited_copy(blocks, tmp_path: Path) -> tuple[Path, list[str]]:
    """A copy of the package with the recipe's edits; and its checks' sources."""
    import blocklab

    package = tmp_path / "blocklab"
    shutil.copytree(
        blocklab.__path__[0], package, ignore=shutil.ignore_patterns("__pycache__")
    )
    checks = []
    for title, source in blocks:
        if title == "check.py":
            checks.append(source)
        else:
            apply_edit(package, title, source)
    assert checks, "a recipe ends with a check"
    return package, checks


def run_recipe(blocks, tmp_path: Path) -> subprocess.CompletedProcess:
    """The recipe's edits on a copy of the package, then its checks."""
    package, checks = edited_copy(blocks, tmp_path)
    prelude = (
        "import blocklab\n"
        f"assert blocklab.__file__.startswith({str(package)!r}), blocklab.__file__\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-c", prelude + "\n".join(checks)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


RECIPES = recipes(PAGE.read_text(encoding="utf-8"))


def test_the_page_has_the_four_recipes():
    assert list(RECIPES) == [
        "A new block option",
        "A new checkpoint family",
        "A new activation site",
        "A new study",
    ]


WORKED = [heading for heading, blocks in RECIPES.items() if blocks]


@pytest.mark.parametrize("heading", WORKED, ids=str)
def test_each_recipe_applies_to_the_current_source(heading, tmp_path):
    """Every anchor line is there, once, and every edited file still parses."""
    package, checks = edited_copy(RECIPES[heading], tmp_path)
    edited = {t.removeprefix("src/blocklab/") for t, _ in RECIPES[heading]}
    for name in sorted(edited - {"check.py"}):
        path = package / name
        compile(path.read_text(encoding="utf-8"), str(path), "exec")
    for source in checks:
        compile(source, "check.py", "exec")


@pytest.mark.slow
@pytest.mark.parametrize("heading", WORKED, ids=str)
def test_each_recipe_applies_and_its_check_passes(heading, tmp_path):
    result = run_recipe(RECIPES[heading], tmp_path)
    assert result.returncode == 0, (
        f"{heading}:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}"
    )


def test_the_machinery_applies_edits_and_reports_a_moved_anchor(tmp_path):
    page = (
        "## One\n"
        '```python title="src/blocklab/m.py"\n'
        "    # after: a = 1\n"
        "    b = 2\n"
        "```\n"
        '```python title="src/blocklab/m.py"\n'
        "# replaces: c = 3\n"
        "c = 4\n"
        "```\n"
        '```python title="src/blocklab/new.py"\n'
        "x = 1\n"
        "```\n"
        "```python\nnot = 'a titled block'\n```\n"
        '```python title="check.py"\n'
        "print(1)\n"
        "```\n"
        "## Two\n"
        "prose only\n"
    )
    found = recipes(page)
    assert list(found) == ["One", "Two"] and found["Two"] == []
    assert [t for t, _ in found["One"]] == [
        "src/blocklab/m.py",
        "src/blocklab/m.py",
        "src/blocklab/new.py",
        "check.py",
    ]
    (tmp_path / "m.py").write_text("class K:\n    a = 1\nc = 3\n")
    for title, source in found["One"][:3]:
        apply_edit(tmp_path, title, source)
    assert (tmp_path / "m.py").read_text() == "class K:\n    a = 1\n    b = 2\nc = 4\n"
    assert (tmp_path / "new.py").read_text() == "x = 1\n"
    with pytest.raises(AssertionError, match="0 lines read 'a = 1'"):
        apply_edit(tmp_path, "src/blocklab/new.py", "# after: a = 1\nb = 2\n")
