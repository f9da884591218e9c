"""Every notebook and example runs end to end at a tiny size (BLOCKLAB_TINY=1)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
EXAMPLES = sorted((ROOT / "examples").glob("*.py"))
ENV = {**os.environ, "BLOCKLAB_TINY": "1", "MPLBACKEND": "Agg"}


#: The heaviest runs (12-40 s each even tiny, on 2 CPU cores) go to the slow
#: set; their functions have default tests of their own (tests/test_moe*.py,
#: tests/test_signal.py, tests/test_identities*.py, tests/test_charlm.py,
#: tests/test_pretrained.py, tests/test_huggingface*.py, tests/test_cli_lr_sweep.py),
#: and `generate_converted.py` still runs a converted model by default.
SLOW = {
    "moe_vs_dense.py",
    "signal_propagation.py",
    "finetune_pretrained.py",
    "convert_llama.py",
    "train_charlm.py",
    "lora_finetune.py",
    "bert_mlm.py",
    "t5_reverse.py",
    "02_charlm.ipynb",
    "03_signal_propagation.ipynb",
    "04_identities.ipynb",
    "07_induction.ipynb",
    "05_lr_sensitivity.ipynb",
    "06_mup_and_proxies.ipynb",
}


def _params(paths):
    return [
        pytest.param(p, marks=pytest.mark.slow) if p.name in SLOW else p for p in paths
    ]


@pytest.mark.parametrize("path", _params(EXAMPLES), ids=lambda p: p.name)
def test_example_runs(path, tmp_path):
    result = subprocess.run(
        [sys.executable, str(path)],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize("path", _params(NOTEBOOKS), ids=lambda p: p.name)
def test_notebook_runs(path, tmp_path, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    for name, value in (("BLOCKLAB_TINY", "1"), ("MPLBACKEND", "Agg")):
        monkeypatch.setenv(name, value)
    nb = nbformat.read(path, as_version=4)
    nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    ).execute()
    errors = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.get("output_type") == "error"
    ]
    assert not errors


def _private_imports(source: str) -> list[str]:
    """Imports of blocklab's CLI layer or private modules in `source`."""
    import re

    return re.findall(
        r"(?:from|import)\s+(blocklab\.(?:commands|cli|report)\b[\w.]*|"
        r"blocklab(?:\.\w+)*\._\w+)",
        source,
    )


@pytest.mark.parametrize("path", EXAMPLES + NOTEBOOKS, ids=lambda p: p.name)
def test_examples_and_notebooks_use_only_the_public_api(path):
    if path.suffix == ".ipynb":
        nbformat = pytest.importorskip("nbformat")
        nb = nbformat.read(path, as_version=4)
        source = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    else:
        source = path.read_text()
    assert _private_imports(source) == []


def test_the_public_api_check_can_fail():
    assert _private_imports("from blocklab.cli.commands import signal as cmd") == [
        "blocklab.cli.commands"
    ]
    assert _private_imports("import blocklab.experiments._render") == [
        "blocklab.experiments._render"
    ]
    assert _private_imports("import blocklab as bl\nfrom blocklab import init") == []
