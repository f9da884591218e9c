"""Tokenizers: `blocklab.load_tokenizer` + encode against `transformers.AutoTokenizer`.

One checkpoint folder's tokenizer, built here (nothing downloads): a
byte-level BPE of `--vocab` (4096) ids trained with `tokenizers` on the Time
Machine text, saved as `tokenizer.json` + `tokenizer_config.json` (as
`blocklab.experiments.real_text.write_tokenizer` writes them). Both libraries
read the same files and run the same Rust tokenizer, so what differs is what
each puts around it. Three measurements, each the median of `--reps`
rounds, the two libraries timed round-robin in one process on the same
threads:

- `load+encode`: read the folder and encode the whole corpus (179 kB) as
  one text (`load_tokenizer(folder).encode(text)` against
  `AutoTokenizer.from_pretrained(folder)(text).input_ids`): what a script
  that tokenizes one file pays;
- `encode`: the whole corpus with a tokenizer already loaded;
- `paragraphs`: a Python loop of one encode per paragraph (322
  calls): the per-call overhead.

One text of 179 kB costs `tokenizers` itself far more than its 322
paragraphs one by one (its encode grows faster than linearly with the
length of one text: 10 kB in about 7 ms, 179 kB in about 0.5 s on a core),
and both libraries pay that alike.

The ids of both are compared (equal: the benchmark exits 1 otherwise).
Target: blocklab at least at parity (ratio = transformers' time / blocklab's
>= 1). Prints human-readable lines and one JSON line. Usage: `python
benchmarks/tokenizer.py [--reps 7] [--threads N] [--vocab 4096]`; with
`--threads N` both run on the first N CPUs (the Rust pool too).
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

# `--threads N` must reach the process before the thread pools start.
if "--threads" in sys.argv:
    _n = int(sys.argv[sys.argv.index("--threads") + 1])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:_n])
    os.environ["RAYON_NUM_THREADS"] = str(_n)

import argparse  # noqa: E402
import json  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import blocklab  # noqa: E402
from blocklab.data.datasets import corpus_path  # noqa: E402
from blocklab.experiments.real_text import train_bpe, write_tokenizer  # noqa: E402
from blocklab.experiments.timing import time_round_robin as round_robin  # noqa: E402


def time_round_robin(fns: dict, reps: int) -> dict:
    """name -> median seconds of `reps` calls, the names taken in turn."""
    return {k: t.median for k, t in round_robin(fns, reps).items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument(
        "--threads", type=int, default=len(os.sched_getaffinity(0)),
        help="CPU threads of both libraries (the first N CPUs)",
    )  # fmt: skip
    args = parser.parse_args()

    import transformers

    text = corpus_path().read_text(encoding="utf-8")
    paragraphs = [p for p in text.split("\n\n") if p]
    result = {
        "threads": args.threads, "vocab": args.vocab, "bytes": len(text.encode()),
        "paragraphs": len(paragraphs), "reps": args.reps,
        "load_average_before": os.getloadavg()[0], "rows": {},
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "tokenizer"
        # model_max_length above the corpus: no warning from transformers
        write_tokenizer(train_bpe(text, args.vocab), folder, max_len=1 << 30)

        ours = blocklab.load_tokenizer(folder)
        theirs = transformers.AutoTokenizer.from_pretrained(folder)
        same = ours.encode(text) == theirs(text).input_ids and all(
            ours.encode(p) == theirs(p).input_ids for p in paragraphs
        )
        result["same_ids"] = same
        result["tokens"] = len(ours.encode(text))

        cases = {
            "load+encode": {
                "blocklab": lambda: blocklab.load_tokenizer(folder).encode(text),
                "transformers": lambda: (
                    transformers.AutoTokenizer.from_pretrained(folder)(text).input_ids
                ),
            },
            "encode": {
                "blocklab": lambda: ours.encode(text),
                "transformers": lambda: theirs(text).input_ids,
            },
            "paragraphs": {
                "blocklab": lambda: [ours.encode(p) for p in paragraphs],
                "transformers": lambda: [theirs(p).input_ids for p in paragraphs],
            },
        }
        for case, fns in cases.items():
            med = time_round_robin(fns, args.reps)
            row = {f"{k}_s": v for k, v in med.items()}
            row["ratio"] = med["transformers"] / med["blocklab"]
            result["rows"][case] = row
            print(
                f"{case}: blocklab {1e3 * med['blocklab']:.1f} ms, transformers "
                f"{1e3 * med['transformers']:.1f} ms: ratio {row['ratio']:.2f}x "
                f"(target >= 1)",
                flush=True,
            )
    result["load_average_after"] = os.getloadavg()[0]
    print(f"same ids: {same}; {result['tokens']} tokens of {result['bytes']} bytes")
    print(json.dumps(result))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
