"""Execute the notebooks at their committed size and stamp them.

    python3 -m blocklab.experiments._notebooks notebooks/01_block_anatomy.ipynb ...

runs each notebook top to bottom (in a temporary working folder, so figures
it writes do not land in the repository), keeps its outputs (figures
included) and records in its metadata, under `blocklab`:

- `code_sha256`: the hash of its code cells' sources (`code_hash`);
- `tiny`: whether it ran with `BLOCKLAB_TINY=1` (committed notebooks must not);
- the versions of blocklab and JAX it ran with.

`tests/test_notebooks_fresh.py` recomputes the hash: a code cell edited
after the notebook was executed makes it fail, until the notebook is
executed again with this script.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["code_hash", "execute"]

#: The metadata key of the stamp.
STAMP = "blocklab"


def code_hash(nb) -> str:
    """SHA-256 of the notebook's code cells' sources, in order (hex)."""
    h = hashlib.sha256()
    for cell in nb.cells:
        if cell.cell_type == "code":
            source = (
                cell.source if isinstance(cell.source, str) else "".join(cell.source)
            )
            h.update(source.strip().encode())
            h.update(b"\0")
    return h.hexdigest()


def execute(path: str | Path, *, timeout: int = 1800, tiny: bool = False) -> float:
    """Execute the notebook at `path` in place and stamp it; returns the seconds.

    The notebook is written atomically, and only if every cell ran.
    """
    import jax
    import nbclient
    import nbformat

    from .. import __version__
    from .._io import atomic_write

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    env = {"MPLBACKEND": "Agg"}
    saved = {k: os.environ.get(k) for k in (*env, "BLOCKLAB_TINY")}
    os.environ.update(env)
    if tiny:
        os.environ["BLOCKLAB_TINY"] = "1"
    else:
        os.environ.pop("BLOCKLAB_TINY", None)
    t0 = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as work:
            nbclient.NotebookClient(
                nb,
                timeout=timeout,
                kernel_name="python3",
                resources={"metadata": {"path": work}},
            ).execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    seconds = time.perf_counter() - t0
    for cell in nb.cells:  # timings would make every rerun a diff
        cell.metadata.pop("execution", None)
    nb.metadata[STAMP] = {
        "code_sha256": code_hash(nb),
        "tiny": tiny,
        "blocklab": __version__,
        "jax": jax.__version__,
        "seconds": round(seconds, 1),
    }
    atomic_write(path, nbformat.writes(nb) + "\n", owner="execute notebook")
    return seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m blocklab.experiments._notebooks",
        description="Execute notebooks in place at their committed size and stamp "
        "them with the hash of their code cells.",
    )
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=1800, help="seconds per cell")
    parser.add_argument(
        "--tiny", action="store_true", help="BLOCKLAB_TINY=1 (for trying it out)"
    )
    args = parser.parse_args(argv)
    for path in args.notebooks:
        seconds = execute(path, timeout=args.timeout, tiny=args.tiny)
        print(f"{path}: executed in {seconds:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
