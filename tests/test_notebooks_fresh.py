"""Committed notebooks are executed, show their figures, and are not stale.

`python3 -m blocklab.experiments._notebooks NOTEBOOK` executes a notebook and
stamps it with the hash of its code cells; editing a code cell afterwards
makes `test_outputs_are_not_stale` fail until it is executed again.
"""

from pathlib import Path

import pytest

from blocklab.experiments._notebooks import STAMP, code_hash

nbformat = pytest.importorskip("nbformat")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


def _code_cells(nb):
    return [c for c in nb.cells if c.cell_type == "code"]


@pytest.fixture(params=NOTEBOOKS, ids=lambda p: p.name)
def nb(request):
    return nbformat.read(request.param, as_version=4)


def test_outputs_are_not_stale(nb):
    stamp = nb.metadata.get(STAMP)
    assert stamp, "never executed with python3 -m blocklab.experiments._notebooks"
    assert stamp["code_sha256"] == code_hash(nb), (
        "code cells changed since the notebook was executed: rerun "
        "python3 -m blocklab.experiments._notebooks on it"
    )
    assert stamp["tiny"] is False  # committed at its real size, not the test size


def test_every_code_cell_ran_in_order_without_errors(nb):
    counts = [c.get("execution_count") for c in _code_cells(nb)]
    assert all(isinstance(n, int) for n in counts), counts
    assert counts == sorted(counts)
    for cell in _code_cells(nb):
        assert all(o.get("output_type") != "error" for o in cell.get("outputs", []))


def test_figures_are_embedded(nb):
    images = [
        o
        for c in _code_cells(nb)
        for o in c.get("outputs", [])
        if "image/png" in o.get("data", {})
    ]
    assert images, "a committed notebook shows at least one figure"


def test_notebooks_use_only_the_public_api(nb):
    for cell in _code_cells(nb):
        assert "blocklab.cli.commands" not in cell.source
        assert "blocklab.cli" not in cell.source


def test_code_hash_changes_with_a_code_cell_and_only_then():
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_markdown_cell("# title"),
        nbformat.v4.new_code_cell("x = 1"),
    ]
    h = code_hash(nb)
    assert len(h) == 64 and h == code_hash(nb)
    nb.cells[0].source = "# another title"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1\n")]
    assert code_hash(nb) == h  # markdown and outputs do not count
    nb.cells[1].source = "x = 2"
    assert code_hash(nb) != h
    nb.cells[1].source = "x = 1"
    nb.cells.insert(1, nbformat.v4.new_code_cell(""))
    assert code_hash(nb) != h  # an added cell counts, even an empty one
