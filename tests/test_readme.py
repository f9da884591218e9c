"""The README's code runs: every ```python block, as written, in order.

The blocks are extracted from README.md and executed one after the other in
one fresh interpreter (a subprocess), sharing one namespace as a reader's
session would. Each block is compiled with the file name `README.md` and its
own line numbers, so a traceback points at the README line that failed. The
flat layout's import paths (`blocklab.attention`, `bl.gelu`, ...) were removed
in 0.3: the README must show the current ones.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

#: A fenced block that opens with exactly ```python (not ```bash, not ```).
_FENCE = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)

#: Runs the blocks given as (first line, source) pairs in one namespace.
_RUNNER = """\
import time
namespace = {"__name__": "__main__"}
start = time.perf_counter()
for line, source in BLOCKS:
    print(f"--- README.md block at line {line}", flush=True)
    code = compile("\\n" * (line - 1) + source, "README.md", "exec")
    exec(code, namespace)
    print(f"    done at {time.perf_counter() - start:.1f} s wall,"
          f" {time.process_time():.1f} s CPU", flush=True)
print("--- all README blocks ran", flush=True)
"""


def python_blocks(markdown: str) -> list[tuple[int, str]]:
    """The ```python blocks of `markdown` as (line of their first code line, source)."""
    return [
        (markdown.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in _FENCE.finditer(markdown)
    ]


def run_blocks(blocks: list[tuple[int, str]], cwd: Path, timeout: float = 600):
    """Run `blocks` in order in one fresh interpreter; the CompletedProcess."""
    program = f"BLOCKS = {blocks!r}\n{_RUNNER}"
    env = {**os.environ, "MPLBACKEND": "Agg"}
    return subprocess.run(
        [sys.executable, "-c", program],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_blocks_are_extracted_in_order_with_their_line_numbers():
    markdown = (
        "# title\n"  # line 1
        "```bash\n"
        "echo no\n"
        "```\n"
        "```python\n"  # line 5
        "a = 1\n"  # line 6
        "b = a + 1\n"
        "```\n"
        "text\n"
        "```\n"  # an untyped block (shell output) is not Python
        "blocklab census\n"
        "```\n"
        "```python\n"
        "print(b)\n"  # line 14
        "```\n"
    )
    assert python_blocks(markdown) == [(6, "a = 1\nb = a + 1\n"), (14, "print(b)\n")]


def test_a_failing_block_fails_the_run_and_names_its_readme_line(tmp_path):
    blocks = [(3, "import math\nx = math.sqrt(4)\n"), (10, "\n\ny = x + undefined\n")]
    result = run_blocks(blocks, tmp_path, timeout=60)
    assert result.returncode != 0
    assert 'File "README.md", line 12' in result.stderr
    assert "NameError" in result.stderr
    ok = run_blocks(
        [(3, "import math\nx = math.sqrt(4)\n"), (10, "y = x + 1\n")], tmp_path
    )
    assert ok.returncode == 0, ok.stderr


def test_an_old_import_path_in_a_block_fails_the_run(tmp_path):
    result = run_blocks(
        [(1, "import blocklab as bl\nbl.gelu\n")], tmp_path, timeout=120
    )
    assert result.returncode != 0
    assert "AttributeError: module 'blocklab' has no attribute 'gelu'" in result.stderr


def resolve(dotted: str):
    """The module or attribute that `dotted` (`blocklab.nn.functional.gelu`)
    names; `ImportError` or `AttributeError` when it names nothing."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def _documented_paths(markdown: str) -> set[str]:
    """Every dotted `blocklab.x.y` path written in `markdown` (prose and code)."""
    return set(re.findall(r"\bblocklab(?:\.[A-Za-z_]\w*)+", markdown))


def _bl_names(markdown: str) -> set[str]:
    """Every `bl.Name` used in the ```python blocks of `markdown`."""
    code = "\n".join(source for _, source in python_blocks(markdown))
    return set(re.findall(r"\bbl\.([A-Za-z_]\w*)", code))


#: Old paths the README may name as old (removed in 0.3).
OLD_PATHS_NAMED_AS_OLD = {"blocklab.attention"}


@pytest.mark.parametrize("doc", ["README.md", "benchmarks/README.md"])
def test_every_documented_path_is_a_current_one(doc):
    import blocklab as bl

    markdown = (ROOT / doc).read_text(encoding="utf-8")
    paths = _documented_paths(markdown)
    for path in sorted(paths - OLD_PATHS_NAMED_AS_OLD):
        resolve(path)  # raises on a path that names nothing
    for path in sorted(paths & OLD_PATHS_NAMED_AS_OLD):
        with pytest.raises((ImportError, AttributeError)):
            resolve(path)  # named as old, and gone indeed
    names = _bl_names(markdown)
    assert sorted(names - set(bl.__all__)) == []
    for _, source in python_blocks(markdown):
        compile(source, doc, "exec")


def test_the_path_check_can_fail():
    markdown = "`blocklab.attention` and `blocklab.nn.nothing_here`\n"
    assert _documented_paths(markdown) == {
        "blocklab.attention",
        "blocklab.nn.nothing_here",
    }
    with pytest.raises(AttributeError, match="no attribute 'gelu'"):
        resolve("blocklab.gelu")
    with pytest.raises(AttributeError, match="no attribute 'attention'"):
        resolve("blocklab.attention.MultiHeadAttention")
    with pytest.raises(AttributeError):
        resolve("blocklab.nn.nothing_here")
    assert _bl_names("```python\nbl.gelu(x)\n```\n") == {"gelu"}
    assert resolve("blocklab.nn.functional.gelu").__name__ == "gelu"


@pytest.mark.slow  # about 130 s of CPU time (compilation, mostly)
def test_every_readme_python_block_runs_in_order(tmp_path):
    pytest.importorskip("torch", reason="the porting block builds a PyTorch block")
    pytest.importorskip("transformers", reason="the conversion block builds a Llama")
    blocks = python_blocks(README.read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    result = run_blocks(blocks, tmp_path, timeout=1200)  # 7 min on a loaded machine
    if result.returncode != 0:
        pytest.fail(
            f"a README block failed:\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}",
            pytrace=False,
        )
    assert result.stdout.count("--- README.md block at line") == len(blocks)
