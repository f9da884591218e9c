r"""A token pipeline for corpora on disk: tokenize once, then packed, shuffled batches.

Two steps, each for corpora larger than memory:

1. `tokenize_files(paths, tokenizer, out)` reads UTF-8 text files in chunks of
   `chunk_bytes`, cuts them into documents (a whole file, or the pieces
   between occurrences of `separator`), encodes each document with
   `tokenizer.encode` and appends its ids and `tokenizer.eos_id` to the token
   folder `out`, written as it goes and renamed into place at the end
   (`blocklab._io.atomic_dir`: a failure leaves nothing behind). The folder
   holds `tokens.npy`, one flat array (uint16 when the vocabulary fits, else
   uint32; `np.load(..., mmap_mode="r")` reads it in place), and
   `meta.json`: its dtype, token and document counts, EOS id, the
   tokenizer's identity, and each source file's path, size and SHA-256. A
   second call with the same files and tokenizer reuses the folder.
2. `TokenPipeline(TokenFile(out), seq_len=n, batch_size=B, seed=s)` is a
   batch source of `blocklab.train_model`: `batch_at(step)` reads its windows
   from the memory map, so the whole corpus is never loaded.

Windows. The corpus $c_0 \ldots c_{L-1}$ (each document followed by EOS) is
cut as `pack_documents` cuts documents: window $w$ is
$c_{wn} \ldots c_{wn+n}$ ($n + 1$ tokens, stride $n$), its inputs
$X = c_{wn} \ldots c_{wn+n-1}$ and next-token targets
$Y = c_{wn+1} \ldots c_{wn+n}$. With `segment_ids=True` there are
$N = \lceil (L-1)/n \rceil$ windows; the last one's missing tokens are EOS
with segment id -1 (masked). With `segment_ids=False`, $N = \lfloor
(L-1)/n \rfloor$ and the last $(L-1) \bmod n$ targets, shorter than a window,
are left out.

Exactly once. Batch `step` holds the windows drawn $g = sB \ldots sB + B - 1$;
draw $g$ is epoch $e = \lfloor g/N \rfloor$, window $\pi_e(g \bmod N)$, where
$\pi_e$ is a permutation of $0 \ldots N-1$ derived from `(seed, e)`. So each
epoch (every $N$ draws, which may end inside a batch) holds every window
once: every position $1 \ldots nN$ of the corpus is a target, and every
position $0 \ldots nN - 1$ an input, exactly once ($nN \ge L - 1$ with
segment ids, where that is every token).

Segments (`segment_ids=True`): a document ends with its EOS, so a token's
segment id is the number of EOS before it in its window, $-1$ on padding;
these are `pack_documents`' ids for the same documents (renumbered from 0 in
each window). An EOS that `encode` itself returns inside a document (a
special token written in the text) ends a segment there too. Batches are
then `(X, Y, S)` with `S` the whole windows' ids `(B, n + 1)`, as
`blocklab.lm_loss(model, X, Y, segment_ids=S)` takes them: no target across
a document boundary or on padding counts, and positions restart in each
document. With `segment_ids=False` they are `(X, Y)`, the
default next-token loss's batch.

Order. $\pi_e$ is a six-round Feistel network on $2^{2h} \ge N$ indices with
cycle walking (a bijection of $0 \ldots N-1$), its round keys hashed
(SplitMix64) from `(seed, e)`. A batch's windows cost $O(B)$ whatever $N$
(no permutation is stored), and the order is fixed by this code, not by a
NumPy version. Resuming: `batch_at(step)` is a function of `step` alone, so
`batches(start=k)` continues an interrupted run exactly.

Why not `grain` (0.2.18): its `MapDataset.shuffle` is the same idea (an
index shuffle per epoch), but it needs Python >= 3.11 (blocklab: 3.10) and
array_record, protobuf and etils; it seeds epoch $e$ with $s + e$, so seed
0's second epoch is seed 1's first (a seed sweep would share orders); its
packing numbers segments from 1 with 0 for padding, not `pack_documents`'
0 and -1; and it has no text-file tokenizer.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from jaxtyping import Int
from tqdm.auto import tqdm

from .._io import atomic_dir
from .._validate import ConfigError, check_bool, check_int

__all__ = ["TokenFile", "TokenPipeline", "tokenize_files"]

_FORMAT = "blocklab-tokens"
_VERSION = 1
_TOKENS = "tokens.npy"
_META = "meta.json"
_MASK64 = (1 << 64) - 1
_ROUNDS = 6


class TokenFile:
    """A token folder written by `tokenize_files`, its tokens memory-mapped.

    Attributes:
        path: the folder.
        tokens: `(num_tokens,)` read-only `np.memmap` (uint16 or uint32): every
            document's ids, each followed by `eos_id`.
        num_tokens, num_documents: the counts (EOS included in the tokens).
        eos_id: the id that ends each document.
        vocab_size: the tokenizer's `vocab_size`, or `None` if it had none.
        meta: the whole `meta.json` (also the tokenizer's identity and the
            source files with their sizes and SHA-256).
    """

    def __init__(self, path: str | os.PathLike):
        owner = "TokenFile"
        folder = Path(path)
        meta = _read_meta(folder)
        if meta is None:
            raise ConfigError(
                f"{owner}: {folder} is not a token folder (no {_META} of format "
                f"{_FORMAT!r}); write one with blocklab.data.tokenize_files."
            )
        try:
            tokens = np.load(folder / _TOKENS, mmap_mode="r")
        except (OSError, ValueError) as err:
            raise ConfigError(
                f"{owner}: cannot read {folder / _TOKENS}: {err}"
            ) from err
        if tokens.shape != (meta["num_tokens"],) or tokens.dtype != meta["dtype"]:
            raise ConfigError(
                f"{owner}: {folder / _TOKENS} holds {tokens.dtype} {tokens.shape} but "
                f"{folder / _META} says {meta['dtype']} ({meta['num_tokens']},); "
                "tokenize the files again."
            )
        self.path = folder
        self.tokens = tokens
        self.meta = meta
        self.num_tokens = int(meta["num_tokens"])
        self.num_documents = int(meta["num_documents"])
        self.eos_id = int(meta["eos_id"])
        self.vocab_size = meta["vocab_size"]

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (
            f"TokenFile({str(self.path)!r}, num_tokens={self.num_tokens}, "
            f"num_documents={self.num_documents}, dtype={self.tokens.dtype})"
        )


def tokenize_files(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: Any,
    out: str | os.PathLike,
    *,
    separator: str | None = None,
    chunk_bytes: int = 1 << 20,
    overwrite: bool = False,
    progress: bool = True,
) -> TokenFile:
    r"""Tokenize text files once into a memory-mapped token folder.

    Each file is read in chunks of `chunk_bytes` and decoded as UTF-8 (no
    newline translation); its documents are the whole file (`separator`
    `None`) or the pieces of `text.split(separator)`, empty ones skipped. A
    document is encoded whole (so the ids are `tokenizer.encode(document)`,
    whatever the chunking) and written at once, followed by `eos_id`; memory
    holds one chunk and one document, never the corpus or its tokens.

    If `out` already holds the tokens of the same files (paths, sizes,
    SHA-256), separator and tokenizer, it is returned as it is.

    Args:
        paths: a text file or a sequence of them, in corpus order.
        tokenizer: any object with `encode(str) -> list[int]` and an integer
            `eos_id` (e.g. `blocklab.load_tokenizer(folder)`); its optional
            `vocab_size` picks uint16 (<= 65536) over uint32, and its
            `path` folder's `tokenizer.json` hash identifies it.
        out: the token folder to write (`tokens.npy`, `meta.json`).
        separator: the text between documents within a file (e.g.
            `"<|endoftext|>"`, `"\n\n"`); `None`: one document per file.
        chunk_bytes: bytes read at a time (>= 1).
        overwrite: replace an `out` that holds other tokens.
        progress: show a tqdm bar over the bytes read.

    Returns:
        The `TokenFile` of `out`.

    Raises:
        ConfigError: a path that is not a file; a file that is not UTF-8 text
            (binary: a NUL byte or an invalid byte sequence; the message names
            the file and the byte offset); a tokenizer without `encode` or
            `eos_id`, or an id outside `[0, vocab_size)`; no document at all;
            an `out` holding other tokens without `overwrite`. Nothing is
            written in any of these cases, nor when `encode` raises.
    """
    owner = "tokenize_files"
    files = _check_paths(owner, paths)
    eos_id, vocab_size = _check_tokenizer(owner, tokenizer)
    if separator is not None and not (isinstance(separator, str) and separator):
        raise ConfigError(
            f"{owner}: separator must be a non-empty str or None (one document per "
            f"file), got {separator!r}."
        )
    chunk_bytes = check_int(owner, "chunk_bytes", chunk_bytes, min=1)
    overwrite = check_bool(owner, "overwrite", overwrite)
    progress = check_bool(owner, "progress", progress)
    out = Path(out)
    ident = _identity(tokenizer, eos_id, vocab_size)
    if out.exists():
        old = _read_meta(out)
        if old is not None and _same_corpus(old, files, ident, separator):
            try:
                return TokenFile(out)
            except ConfigError as err:  # damaged: written again with overwrite
                if not overwrite:
                    raise ConfigError(
                        f"{owner}: {out} is for these files but cannot be read "
                        f"({err}); pass overwrite=True to write it again."
                    ) from err
        elif old is not None and not overwrite:
            raise ConfigError(
                f"{owner}: {out} holds the tokens of other files, another "
                "separator or another tokenizer; pass overwrite=True to replace "
                "them, or write to another folder."
            )
    dtype = np.dtype(np.uint16 if vocab_size and vocab_size <= 1 << 16 else np.uint32)
    limit = vocab_size or 1 << 32
    sources, num_tokens, num_docs = [], 0, 0
    total = sum(f.stat().st_size for f in files)
    with (
        atomic_dir(out, owner=owner, overwrite=overwrite) as tmp,
        open(tmp / _TOKENS, "wb") as sink,
        tqdm(
            total=total, desc=owner, unit="B", unit_scale=True, disable=not progress
        ) as bar,
    ):
        header = _write_header(sink, dtype, 0)
        for file in files:
            digest = hashlib.sha256()
            tokens_before, docs_before = num_tokens, num_docs
            for text in _documents(owner, file, separator, chunk_bytes, digest, bar):
                ids = _checked_ids(owner, tokenizer.encode(text), limit, file, num_docs)
                ids = np.append(ids, eos_id).astype(dtype)
                sink.write(ids.tobytes())
                num_tokens += len(ids)
                num_docs += 1
            sources.append(
                {
                    "path": str(file),
                    "bytes": file.stat().st_size,
                    "sha256": digest.hexdigest(),
                    "documents": num_docs - docs_before,
                    "tokens": num_tokens - tokens_before,
                }
            )
        if num_docs == 0:
            raise ConfigError(
                f"{owner}: the files hold no document (every one is empty): "
                f"{', '.join(str(f) for f in files)}."
            )
        sink.seek(0)
        if _write_header(sink, dtype, num_tokens) != header:
            raise RuntimeError(
                f"{owner}: NumPy {np.__version__} wrote .npy headers of two lengths "
                "for one dtype; the token count cannot be written last."
            )
        meta = {
            "format": _FORMAT,
            "version": _VERSION,
            "dtype": dtype.name,
            "num_tokens": num_tokens,
            "num_documents": num_docs,
            "eos_id": eos_id,
            "vocab_size": vocab_size,
            "separator": separator,
            "tokenizer": ident,
            "sources": sources,
        }
        (tmp / _META).write_text(json.dumps(meta, indent=2) + "\n")
    return TokenFile(out)


class TokenPipeline:
    r"""Packed, shuffled, resumable batches of a token file.

    Batch $s$ holds the windows of draws $g = sB \ldots sB + B - 1$, draw
    $g$ being window $\pi_{\lfloor g/N \rfloor}(g \bmod N)$ of the $N$
    windows of $n + 1$ tokens at stride $n$ (see the module docstring for
    the windows, the tail, the permutations $\pi_e$ and the exact-once rule).

    A host batch source: `blocklab.train_model(model, pipeline, ...)` trains
    step $s$ on `batch_at(s)`; resume a run at step $k$ with
    `train_model(..., pipeline.batches(start=k), state=state)`. With
    `segment_ids=True` pass the loss `lambda model, batch, key:
    blocklab.lm_loss(model, *batch[:2], segment_ids=batch[2])`.

    Attributes:
        tokens: the `TokenFile`.
        seq_len, batch_size, seed, segment_ids: as given.
        num_windows: $N$, the windows of one epoch.
    """

    def __init__(
        self,
        tokens: TokenFile | str | os.PathLike,
        *,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        segment_ids: bool = True,
    ):
        r"""Args:
        tokens: a `TokenFile` or its folder.
        seq_len: input tokens per sequence $n \ge 1$.
        batch_size: sequences per batch $B \ge 1$.
        seed: the order's seed, an int in $[0, 2^{64})$.
        segment_ids: batches `(X, Y, S)` with the windows' segment ids, the
            tail padded; `False`: batches `(X, Y)`, the tail left out.
        """
        owner = "TokenPipeline"
        self.tokens = tokens if isinstance(tokens, TokenFile) else TokenFile(tokens)
        self.seq_len = check_int(owner, "seq_len", seq_len, min=1)
        self.batch_size = check_int(owner, "batch_size", batch_size, min=1)
        self.seed = check_int(owner, "seed", seed, min=0, max=_MASK64)
        self.segment_ids = check_bool(owner, "segment_ids", segment_ids)
        L, n = self.tokens.num_tokens, self.seq_len
        self.num_windows = -(-(L - 1) // n) if self.segment_ids else (L - 1) // n
        if self.num_windows < 1:
            fix = "a shorter seq_len, or segment_ids=True (pads the tail)"
            raise ConfigError(
                f"{owner}: the corpus has {L} tokens, fewer than one window of "
                f"seq_len + 1 = {n + 1}"
                + (f"; use {fix}." if L > 1 else ": a window needs 2 tokens.")
            )

    def __repr__(self) -> str:
        return (
            f"TokenPipeline({self.tokens!r}, seq_len={self.seq_len}, "
            f"batch_size={self.batch_size}, seed={self.seed}, "
            f"segment_ids={self.segment_ids})"
        )

    def window_ids(self, step: int) -> Int[np.ndarray, " B"]:
        """The windows of batch `step`: window $w$ starts at token $wn$."""
        step = check_int("TokenPipeline.window_ids", "step", step, min=0)
        B, N = self.batch_size, self.num_windows
        draws = step * B + np.arange(B, dtype=np.int64)
        epochs, slots = np.divmod(draws, N)
        out = np.empty(B, np.int64)
        for e in np.unique(epochs):
            at = epochs == e
            out[at] = _permute(slots[at], N, _epoch_key(self.seed, int(e)))
        return out

    def batch_at(self, step: int) -> tuple[Int[np.ndarray, "B _"], ...]:
        """Batch `step`: `(X, Y, S)` (segment ids) or `(X, Y)`, int32 NumPy arrays.

        `X`, `Y` are `(B, seq_len)`, `S` is `(B, seq_len + 1)`. A function of
        `step` alone: the same in an unbroken run and after a resume.
        """
        n, L, eos = self.seq_len, self.tokens.num_tokens, self.tokens.eos_id
        at = self.window_ids(step)[:, None] * n + np.arange(n + 1)
        inside = at < L
        windows = np.asarray(self.tokens.tokens[np.minimum(at, L - 1)], np.int32)
        windows[~inside] = eos
        X, Y = windows[:, :-1], windows[:, 1:]
        if not self.segment_ids:
            return X, Y
        ends = np.cumsum(X == eos, axis=1, dtype=np.int32)
        S = np.concatenate([np.zeros_like(ends[:, :1]), ends], axis=1)
        return X, Y, np.where(inside, S, -1).astype(np.int32)

    def batches(self, start: int = 0) -> Iterator[tuple[Int[np.ndarray, "B _"], ...]]:
        """`batch_at(start)`, `batch_at(start + 1)`, ... without end."""
        step = check_int("TokenPipeline.batches", "start", start, min=0)
        while True:
            yield self.batch_at(step)
            step += 1

    def __iter__(self) -> Iterator[tuple[Int[np.ndarray, "B _"], ...]]:
        return self.batches()


def _splitmix(x: int) -> int:
    """SplitMix64's output function of the state `x` (a bijection of 64 bits)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """`_splitmix` without the increment, on a uint64 array (wrapping products)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _epoch_key(seed: int, epoch: int) -> int:
    # Hashed, not added: seed s's epoch e is not seed s + 1's epoch e - 1.
    return _splitmix(_splitmix(seed) ^ epoch)


def _permute(slots: np.ndarray, n: int, key: int) -> np.ndarray:
    r"""$\pi(slots)$ for the permutation of $0 \ldots n-1$ keyed by `key`.

    A balanced Feistel network on $2h$ bits ($2^{2h} \ge n$) is a bijection
    of $0 \ldots 2^{2h}-1$; applying it again to the values that land at or
    past $n$ (cycle walking) restricts it to a bijection of $0 \ldots n-1$.
    """
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(_splitmix(key ^ r)) for r in range(_ROUNDS)]

    def feistel(x):
        left, right = x >> np.uint64(half), x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << np.uint64(half)) | right

    x = feistel(np.asarray(slots, np.uint64))
    out = x >= n
    while out.any():
        x[out] = feistel(x[out])
        out = x >= n
    return x.astype(np.int64)


def _check_paths(owner: str, paths: Any) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if isinstance(paths, (bytes, dict)) or not isinstance(paths, Sequence):
        raise ConfigError(
            f"{owner}: paths must be a text file path or a sequence of them, got "
            f"{type(paths).__name__}."
        )
    files = []
    for p in paths:
        if not isinstance(p, (str, os.PathLike)):
            raise ConfigError(
                f"{owner}: paths must be str or Path, got {p!r} ({type(p).__name__})."
            )
        file = Path(p).resolve()
        if not file.is_file():
            what = "a folder" if file.is_dir() else "not found"
            raise ConfigError(f"{owner}: {p} is not a text file ({what}).")
        files.append(file)
    if not files:
        raise ConfigError(f"{owner}: paths is empty; give at least one text file.")
    return files


def _check_tokenizer(owner: str, tokenizer: Any) -> tuple[int, int | None]:
    eos = getattr(tokenizer, "eos_id", None)
    if not callable(getattr(tokenizer, "encode", None)) or eos is None:
        raise ConfigError(
            f"{owner}: tokenizer must have encode(str) -> list[int] and an eos_id "
            f"(the id that ends each document), got {type(tokenizer).__name__} "
            f"with encode={getattr(tokenizer, 'encode', None)!r}, eos_id={eos!r}."
        )
    vocab = getattr(tokenizer, "vocab_size", None)
    vocab = check_int(owner, "tokenizer.vocab_size", vocab, min=1, optional=True)
    top = (vocab or 1 << 32) - 1
    return check_int(owner, "tokenizer.eos_id", eos, min=0, max=top), vocab


def _identity(tokenizer: Any, eos_id: int, vocab_size: int | None) -> dict:
    """What identifies the tokenizer: its class, EOS and vocabulary size, and the
    SHA-256 of its folder's `tokenizer.json` when it has one (`load_tokenizer`)."""
    cls = type(tokenizer)
    ident: dict[str, Any] = {
        "class": f"{cls.__module__}.{cls.__qualname__}",
        "eos_id": eos_id,
        "vocab_size": vocab_size,
    }
    folder = getattr(tokenizer, "path", None)
    if isinstance(folder, (str, os.PathLike)):
        file = Path(folder) / "tokenizer.json"
        if file.is_file():
            ident["tokenizer_json_sha256"] = hashlib.sha256(
                file.read_bytes()
            ).hexdigest()
    return ident


def _read_meta(folder: Path) -> dict | None:
    """`meta.json` of a token folder, or `None` if `folder` is not one."""
    try:
        meta = json.loads((folder / _META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
        return None
    return meta


def _same_corpus(meta: dict, files: list[Path], ident: dict, sep: str | None) -> bool:
    """Whether `meta` records these files (paths, sizes, SHA-256), separator and
    tokenizer; the files are hashed only when everything cheaper agrees."""
    old = meta.get("sources") or []
    if meta.get("tokenizer") != ident or meta.get("separator") != sep:
        return False
    if [(s.get("path"), s.get("bytes")) for s in old] != [
        (str(f), f.stat().st_size) for f in files
    ]:
        return False
    return all(s.get("sha256") == _sha256(f) for s, f in zip(old, files, strict=True))


def _sha256(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _documents(
    owner: str, file: Path, sep: str | None, chunk: int, digest: Any, bar: Any
) -> Iterator[str]:
    """The non-empty documents of `file`, read `chunk` bytes at a time.

    Equals `[d for d in text.split(sep) if d]` of the whole decoded text: the
    text left over after the last separator found waits for the next chunk,
    and a separator can only end in the newest chunk.
    """
    decoder = codecs.getincrementaldecoder("utf-8")()
    buf, offset = "", 0
    with open(file, "rb") as f:
        while True:
            data = f.read(chunk)
            digest.update(data)
            bar.update(len(data))
            nul = data.find(b"\0")
            if nul >= 0:
                raise _binary(owner, file, offset + nul, "a NUL byte")
            pending = len(decoder.getstate()[0])
            try:
                text = decoder.decode(data, final=not data)
            except UnicodeDecodeError as err:
                at = offset - pending + err.start
                raise _binary(owner, file, at, "a byte that is not UTF-8") from None
            offset += len(data)
            if sep is not None:
                scan = max(0, len(buf) - len(sep) + 1)
                buf += text
                start = 0
                while (i := buf.find(sep, scan)) >= 0:
                    if i > start:
                        yield buf[start:i]
                    start = scan = i + len(sep)
                buf = buf[start:]
            else:
                buf += text
            if not data:
                break
    if buf:
        yield buf


def _binary(owner: str, file: Path, offset: int, what: str) -> ConfigError:
    return ConfigError(
        f"{owner}: {file} is not UTF-8 text ({what} at byte {offset}); is it a "
        "binary file? Give text files only."
    )


def _checked_ids(
    owner: str, ids: Any, limit: int, file: Path, doc: int
) -> Int[np.ndarray, " T"]:
    """`ids` as an int64 array, refused unless 1-D integers in `[0, limit)`."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, np.int64)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ConfigError(
            f"{owner}: tokenizer.encode must return a list of int ids, got "
            f"dtype {arr.dtype}, shape {arr.shape} for document {doc} ({file})."
        )
    arr = arr.astype(np.int64)
    bad = (arr < 0) | (arr >= limit)
    if bad.any():
        j = int(np.argmax(bad))
        raise ConfigError(
            f"{owner}: tokenizer.encode gave id {int(arr[j])} at index {j} of "
            f"document {doc} ({file}); ids must lie in [0, {limit})."
        )
    return arr


def _write_header(sink: Any, dtype: np.dtype, count: int) -> int:
    """Write the `.npy` header of a `(count,)` array here; returns its length.

    NumPy pads the header for any length of the first axis to one size, so
    the count can be written last, over a header for 0.
    """
    header = {
        "descr": np.lib.format.dtype_to_descr(dtype),
        "fortran_order": False,
        "shape": (count,),
    }
    start = sink.tell()
    np.lib.format.write_array_header_1_0(sink, header)
    return sink.tell() - start
