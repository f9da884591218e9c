"""The CLI's persistent compilation cache: a second run of a command skips its compiles.

Runs one `blocklab` command (default: a small `blocklab signal`) in fresh
subprocesses, each with its own empty cache folder (`XDG_CACHE_HOME`):

1. `first`: the cache on and empty: every program is compiled and written;
2. `second`: the same command again, same folder: the programs are read;
3. `off`: `--no-compile-cache`, the reference: a second run without the
   cache, so that warm OS file caches and imports count the same for both.

Reported: wall seconds of each (imports and JAX's start included, which the
cache cannot save), the cache's entries, and the ratios `first / second` and
`off / second` (how much faster a repeated run is). Timings on a shared
machine vary; run `--reps 3` (the best of each is kept) on an idle one.

Prints human-readable lines, then one JSON line. Usage:
`python benchmarks/compile_cache.py [--reps N] [-- COMMAND ARGS ...]`,
e.g. `-- mup --protocol quick --out /tmp/mup`.
"""

from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

DEFAULT = [
    "signal", "--placements", "pre", "post", "--num-seeds", "1", "--blocks", "4",
    "--num-hiddens", "64",
]  # fmt: skip


def _run(cmd: list[str], xdg: Path, *, extra: list[str]) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOCKLAB_")}
    env.update(XDG_CACHE_HOME=str(xdg), JAX_PLATFORMS=env.get("JAX_PLATFORMS", "cpu"))
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    argv = [sys.executable, "-m", "blocklab.cli", *cmd, "--json", *extra]
    t0 = time.perf_counter()
    p = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(
            f"{' '.join(argv)} failed ({p.returncode}):\n{p.stderr[-3000:]}"
        )
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=1, help="rounds (best kept)")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS")
    args = parser.parse_args()
    cmd = [a for a in args.cmd if a != "--"] or DEFAULT
    best = {"first": [], "second": [], "off": []}
    entries = 0
    for _ in range(args.reps):
        with tempfile.TemporaryDirectory() as tmp:
            cached, off = Path(tmp) / "cached", Path(tmp) / "off"
            best["first"].append(_run(cmd, cached, extra=[]))
            entries = len(list((cached / "blocklab" / "jax").glob("*")))
            best["second"].append(_run(cmd, cached, extra=[]))
            best["off"].append(_run(cmd, off, extra=["--no-compile-cache"]))
            assert not (off / "blocklab" / "jax").exists() or not any(
                (off / "blocklab" / "jax").iterdir()
            ), "--no-compile-cache wrote cache entries"
    t = {k: min(v) for k, v in best.items()}
    result = {
        "command": "blocklab " + " ".join(cmd),
        "seconds": {k: round(v, 2) for k, v in t.items()},
        "cache_entries": entries,
        "first_over_second": round(t["first"] / t["second"], 2),
        "off_over_second": round(t["off"] / t["second"], 2),
        "reps": args.reps,
    }
    print(f"{result['command']}: first run {t['first']:.1f} s (compiles, writes "
          f"{entries} cache files), second {t['second']:.1f} s (reads them), "
          f"without the cache {t['off']:.1f} s")  # fmt: skip
    print(f"first / second: {result['first_over_second']:.2f}x; off / second: "
          f"{result['off_over_second']:.2f}x")  # fmt: skip
    print(json.dumps(result))


if __name__ == "__main__":
    main()
