"""`blocklab eval`: perplexity and bits per byte of text files under a checkpoint."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..._io import atomic_write, check_writable
from ..._validate import ConfigError, check_int
from ...data.tokenizer import load_tokenizer
from ...experiments._render import dumps, markdown_table
from ...interop.pretrained import load_pretrained, pretrained_config
from ...text.evaluate import evaluate_text
from ...training.checkpoint import CheckpointError

NAME = "eval"
HELP = (
    "sliding-window perplexity and bits per byte of text files under a checkpoint "
    "folder (blocklab eval PATH --data a.txt --tag code=b.py --seq-len 1024 "
    "--stride 512)"
)
EPILOG = (
    "Each file is one document, scored alone with windows of --seq-len tokens every "
    "--stride tokens (the transformers perplexity guide's loop; each token is scored "
    "once, a document's first token is context only): blocklab.evaluate_text. "
    "Perplexity is exp(NLL / tokens), bits per byte NLL / (ln 2 x UTF-8 bytes). "
    "Files must be UTF-8 text; a binary file (NUL bytes, or bytes that are not "
    "UTF-8) or an empty one is refused before the model is read. --out writes the "
    "JSON result atomically: a failed run leaves no file (and an old one as it was)."
)

#: `--out` is a file (the JSON result), not a folder.
OUTPUT_FILES = ("out",)

#: The default window: the model's max_len, at most this.
MAX_DEFAULT_SEQ_LEN = 1024


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", metavar="PATH",
        help="a checkpoint folder (config.json, safetensors and tokenizer.json)",
    )  # fmt: skip
    parser.add_argument(
        "--data", nargs="+", action="extend", default=[], metavar="FILE",
        help="UTF-8 text files, one document each (untagged)",
    )  # fmt: skip
    parser.add_argument(
        "--tag", action="append", default=[], metavar="NAME=FILE",
        help="a text file tagged NAME (a domain); repeat it: each tag's files are "
        "also scored together",
    )  # fmt: skip
    parser.add_argument(
        "--seq-len", type=int, default=None,
        help="the window in tokens (default: the model's max_len, at most "
        f"{MAX_DEFAULT_SEQ_LEN})",
    )  # fmt: skip
    parser.add_argument(
        "--stride", type=int, default=None,
        help="tokens between windows, 1 <= stride <= seq-len (default: seq-len / 2; "
        "seq-len gives disjoint windows)",
    )  # fmt: skip
    parser.add_argument(
        "--batch-size", type=int, default=8,
        help="windows per model call (default: %(default)s)",
    )  # fmt: skip
    parser.add_argument(
        "--out", default=None, metavar="FILE",
        help="also write the JSON result to FILE (atomically)",
    )  # fmt: skip


def validate(args: argparse.Namespace) -> None:
    """Every argument and every data file checked before the model is read;
    the files' text, the tokenizer and the window are kept for `run`."""
    owner = "blocklab eval"
    if args.out is not None:  # first: a typo in it is named whatever else is wrong
        check_writable(args.out, owner=owner, name="--out")
    tagged = [_split_tag(owner, spec) for spec in args.tag]
    files = [(None, f) for f in args.data] + tagged
    if not files:
        raise ConfigError(
            f"{owner}: no text to score; give --data FILE... or --tag NAME=FILE."
        )
    check_int(owner, "--seq-len", args.seq_len, min=2, optional=True)
    check_int(owner, "--stride", args.stride, min=1, optional=True)
    check_int(owner, "--batch-size", args.batch_size, min=1)
    try:
        max_len = pretrained_config(args.path).max_len
    except CheckpointError as err:
        raise ConfigError(f"{owner}: PATH={args.path!r}: {err}") from None
    seq_len = args.seq_len or min(max_len, MAX_DEFAULT_SEQ_LEN)
    if seq_len > max_len:
        raise ConfigError(
            f"{owner}: --seq-len {seq_len} is longer than the model's max_len="
            f"{max_len}; use --seq-len <= {max_len}."
        )
    stride = args.stride or max(1, seq_len // 2)
    if stride > seq_len:
        raise ConfigError(
            f"{owner}: --stride {stride} is larger than --seq-len {seq_len}: the "
            "windows would skip tokens; use 1 <= --stride <= --seq-len."
        )
    args._tokenizer = load_tokenizer(args.path)
    args._texts = [_read_text(owner, file) for _, file in files]
    args._files = [file for _, file in files]
    args._tags = [tag for tag, _ in files]
    args._seq_len, args._stride = seq_len, stride


def _split_tag(owner: str, spec: str) -> tuple[str, str]:
    name, sep, file = spec.partition("=")
    if not (sep and name and file):
        raise ConfigError(
            f"{owner}: --tag takes NAME=FILE (e.g. --tag code=src.py), got {spec!r}."
        )
    return name, file


def _read_text(owner: str, file: str) -> str:
    """The text of `file`, refused by name if it is missing, empty or binary."""
    path = Path(file)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise ConfigError(f"{owner}: the data file {file!r} {what}.")
    data = path.read_bytes()
    if not data:
        raise ConfigError(f"{owner}: the data file {file!r} is empty.")
    nul = data.find(b"\0")
    if nul >= 0:
        raise ConfigError(
            f"{owner}: the data file {file!r} is binary (a NUL byte at offset "
            f"{nul}); give UTF-8 text files."
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"{owner}: the data file {file!r} is not UTF-8 text (byte "
            f"{data[err.start]:#04x} at offset {err.start}); give UTF-8 text files."
        ) from None


def run(args: argparse.Namespace) -> int:
    model = load_pretrained(args.path)
    result = evaluate_text(
        model, args._tokenizer, args._texts,
        seq_len=args._seq_len, stride=args._stride, tags=args._tags,
        batch_size=args.batch_size, progress=True,
    )  # fmt: skip
    out = result.to_json()
    for doc, file, tag in zip(out["documents"], args._files, args._tags, strict=True):
        doc.update(file=file, tag=tag)
    out = {"path": args.path, "batch_size": args.batch_size, **out}
    text = dumps(out)
    if args.out is not None:
        atomic_write(args.out, text + "\n", owner="blocklab eval")
    if args.json:
        print(text)
        return 0
    print(
        f"{args.path}: seq_len {result.seq_len}, stride {result.stride}, "
        f"{result.windows} windows\n"
    )
    rows = [[d["file"], d["tag"] or "", *_cells(d)] for d in out["documents"]]
    rows += [[f"all {name} files", name, *_cells(s)] for name, s in out["tags"].items()]
    rows.append(["total", "", *_cells(out)])
    header = ["document", "tag", "tokens", "bytes", "NLL", "perplexity", "bits/byte"]
    print(markdown_table(header, rows, align="llrrrrr"))
    if args.out is not None:
        print(f"\nwritten: {args.out}")
    return 0


def _cells(score: dict) -> list[str]:
    return [
        str(score["tokens"]),
        str(score["bytes"]),
        f"{score['nll']:.2f}",
        f"{score['perplexity']:.3f}",
        f"{score['bits_per_byte']:.4f}",
    ]
