r"""Perplexity and bits per byte of text: `evaluate_text`.

A model of context $C$ = `seq_len` scores a document longer than $C$ with a
sliding window, as the `transformers` guide "Perplexity of fixed-length
models" does it. A document of $N$ tokens $x_0, \ldots, x_{N-1}$ (its
`tokenizer.encode(text)`: BOS first where the tokenizer adds one, as the
guide's `tokenizer(text)`) is cut into windows $[b_k, e_k)$ with
$b_k = k s$ ($s$ = `stride`) and $e_k = \min(b_k + C, N)$, for
$k = 0, 1, \ldots$ until a window reaches the end ($e_k = N$). Window $k$
scores only the tokens no earlier window scored, each given the window's
tokens before it as context:
$$\mathrm{NLL} = -\sum_k \sum_{i = \max(e_{k-1},\, b_k + 1)}^{e_k - 1}
\log p_\theta(x_i \mid x_{b_k}, \ldots, x_{i-1}),\qquad e_{-1} = 0.$$
So every token but the first is scored exactly once, with at least $C - s$
tokens of context (or all before it), and the first token of a document (BOS,
or the first text token when the tokenizer adds none) is never scored: no
window has a token before it. BOS is added once, at the start of the
document, never at the start of a later window. With `stride = seq_len` the
windows do not overlap, and the first token of every window is context only
(the guide's convention: a window's first label is dropped by the model's
shift).

From the summed NLL (nats), the scored token count $n$ and the UTF-8 byte
count $B$ of the text, perplexity is $\exp(\mathrm{NLL}/n)$ and bits per
byte is $\mathrm{NLL} / (B \ln 2)$ (all bytes of the text, though the first
token is not scored). A collection (all documents, or those of one tag) sums
NLL, tokens and bytes over its documents, then takes the same ratios: the
token-weighted mean, not the mean of the documents' perplexities.

One difference from the guide's code, which multiplies each window's mean
loss by `num_valid_tokens - 1`: a window that overlaps its predecessor has
no label at its first position to drop, so its loss averages over all its
`trg_len` targets, and the guide's total counts one token fewer than it
scored (and weights that window's mean accordingly). `evaluate_text` sums
the scored tokens' log-likelihoods and counts each scored token; for
`stride = seq_len` (no overlap) the two are the same computation, except
where a document's last window holds one token: it scores nothing, and the
guide's mean over no labels is NaN; `evaluate_text` skips that window.

The windows of all documents are scored in batches of `batch_size` by one
compiled program (two where the first windows of documents score more rows
than the later ones, `stride < seq_len - 1`): the last batch is padded with
empty windows, a short window with token 0 after its end (causal: it does
not change the logits before it), and only the rows that score a token
reach the head and the float32 log-softmax, in chunks of at most
`LOGITS_PER_CHUNK` logits (a large vocabulary at a long `seq_len` never
holds the logits of a whole batch).
"""

from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, Int
from tqdm.auto import tqdm

from .._validate import ConfigError, check_bool, check_int
from ..models import CharLM, DecoderLM
from ..models.decoding import model_limits
from ..training.losses import token_cross_entropy
from ._checks import check_ids_in_vocab, check_text_list

__all__ = ["EvalResult", "TextScore", "evaluate_text"]

_OWNER = "evaluate_text"

#: The most logits the head computes at once (float32: 256 MiB): a batch's
#: scored rows go through the head in chunks of this many logits.
LOGITS_PER_CHUNK = 2**26


@dataclasses.dataclass(frozen=True)
class TextScore:
    r"""The sliding-window score of a text, or of a collection of texts.

    Attributes:
        nll: the summed negative log-likelihood of the scored tokens, in nats.
        tokens: the number of scored tokens $n$ (each document's first token
            is context only).
        bytes: the UTF-8 bytes $B$ of the text(s).
    """

    nll: float
    tokens: int
    bytes: int

    @property
    def perplexity(self) -> float:
        r"""$\exp(\mathrm{NLL} / n)$ (`inf` past the float range)."""
        mean = self.nll / self.tokens
        return math.exp(mean) if mean < 709.0 else math.inf

    @property
    def bits_per_byte(self) -> float:
        r"""$\mathrm{NLL} / (B \ln 2)$."""
        return self.nll / (math.log(2.0) * self.bytes)

    def to_json(self) -> dict[str, Any]:
        """The fields and both ratios, as plain numbers."""
        return {
            "nll": self.nll,
            "tokens": self.tokens,
            "bytes": self.bytes,
            "perplexity": self.perplexity,
            "bits_per_byte": self.bits_per_byte,
        }


@dataclasses.dataclass(frozen=True)
class EvalResult(TextScore):
    """What `evaluate_text` returns: the score of all documents together
    (`nll`, `tokens`, `bytes`, `perplexity`, `bits_per_byte`), of each, and of
    each tag.

    Attributes:
        seq_len, stride: the window and its step.
        windows: the number of windows scored (model calls of one sequence).
        documents: one `TextScore` per text, in order.
        tags: the score of each tag's documents together, by tag (in the
            order tags first appear); empty without `tags`.
    """

    seq_len: int
    stride: int
    windows: int
    documents: tuple[TextScore, ...]
    tags: Mapping[str, TextScore]

    def to_json(self) -> dict[str, Any]:
        """Strict-JSON-ready: the totals, then `documents` and `tags`."""
        return {
            **super().to_json(),
            "seq_len": self.seq_len,
            "stride": self.stride,
            "windows": self.windows,
            "documents": [d.to_json() for d in self.documents],
            "tags": {name: s.to_json() for name, s in self.tags.items()},
        }


def evaluate_text(
    model: eqx.Module,
    tokenizer: Any,
    texts: str | Sequence[str],
    *,
    seq_len: int,
    stride: int,
    tags: Sequence[str | None] | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> EvalResult:
    """Sliding-window negative log-likelihood, perplexity and bits per byte.

    Each text is one document, scored alone (windows never span two) as the
    module documentation states: windows of `seq_len` tokens every `stride`
    tokens, each scoring the tokens after the previous window's end, the
    first window all but the document's first token.

    Args:
        model: a `DecoderLM` (any family) or a `CharLM`.
        tokenizer: `encode(str) -> list[int]` with ids in the model's
            vocabulary (`blocklab.load_tokenizer(path)`; `blocklab.data.VOCAB`
            for a character-level `CharLM`). BOS is what `encode` adds.
        texts: one document (a `str`) or a non-empty list of them; each must
            encode to at least 2 tokens.
        seq_len: the window, `2 <= seq_len <=` the model's `max_len`.
        stride: the step between windows, `1 <= stride <= seq_len`; smaller
            gives each token more context and costs `seq_len / stride` times
            the model calls.
        tags: one tag per text (`None` for an untagged one), e.g. the domain
            of its file; each tag's documents are also scored together.
        batch_size: windows per model call, >= 1 (the last batch is padded).
        progress: show a tqdm bar over the windows (on stderr).

    Returns:
        An `EvalResult`: totals, `documents` and `tags`.

    Raises:
        ConfigError: naming the argument: a model of another type, a
            tokenizer without `encode`, a text that is not a non-empty `str`
            or encodes to fewer than 2 tokens or to ids outside the model's
            vocabulary, `stride > seq_len`, `stride < 1`, `seq_len` over the
            model's `max_len`, `tags` of another length or not strings.
    """
    if not isinstance(model, (DecoderLM, CharLM)):
        raise ConfigError(
            f"{_OWNER}: model must be a DecoderLM or a CharLM, got "
            f"{type(model).__name__}."
        )
    vocab, max_len = model_limits(model)
    if not callable(getattr(tokenizer, "encode", None)):
        raise ConfigError(
            f"{_OWNER}: tokenizer must have an encode(str) -> list[int] method, "
            f"got {type(tokenizer).__name__}; load one with "
            "blocklab.load_tokenizer(path)."
        )
    seq_len = check_int(_OWNER, "seq_len", seq_len, min=2)
    if seq_len > max_len:
        raise ConfigError(
            f"{_OWNER}: seq_len={seq_len} is longer than the model's max_len="
            f"{max_len}; use seq_len <= {max_len}."
        )
    stride = check_int(_OWNER, "stride", stride, min=1)
    if stride > seq_len:
        raise ConfigError(
            f"{_OWNER}: stride={stride} is larger than seq_len={seq_len}: the "
            "windows would skip tokens; use 1 <= stride <= seq_len (stride = "
            "seq_len for disjoint windows)."
        )
    batch_size = check_int(_OWNER, "batch_size", batch_size, min=1)
    progress = check_bool(_OWNER, "progress", progress)
    docs = check_text_list(
        _OWNER, "texts", [texts] if isinstance(texts, str) else texts
    )
    names = (
        ["texts"]
        if isinstance(texts, str)
        else [f"texts[{i}]" for i in range(len(docs))]
    )
    tag_of = _tags(tags, len(docs))
    ids = [_encode(tokenizer, t, n, vocab) for t, n in zip(docs, names, strict=True)]

    windows = _windows([len(x) for x in ids], seq_len, stride)
    num_windows = len(windows["doc"])
    later = min(stride, seq_len - 1)
    windows = _merge_first_windows(windows, later, batch_size)
    window_nll = np.zeros(len(windows["doc"]), np.float64)
    groups = [windows["count"] <= later, windows["count"] > later]
    chunk = max(1, LOGITS_PER_CHUNK // (batch_size * vocab))
    with tqdm(
        total=len(window_nll), desc="eval", unit="window", disable=not progress
    ) as bar:
        for rows, group in zip((later, seq_len - 1), groups, strict=True):
            chosen = np.flatnonzero(group)
            for start in range(0, len(chosen), batch_size):
                part = chosen[start : start + batch_size]
                batch = _batch(ids, windows, part, seq_len, rows, batch_size)
                nll = np.asarray(_window_nll(model, *batch, chunk), np.float64)
                window_nll[part] = nll[: len(part)]
                bar.update(len(part))

    nll = np.zeros(len(docs), np.float64)
    np.add.at(nll, windows["doc"], window_nll)
    tokens = np.zeros(len(docs), np.int64)
    np.add.at(tokens, windows["doc"], windows["count"])
    sizes = [len(t.encode("utf-8")) for t in docs]
    documents = tuple(
        TextScore(float(n), int(k), b)
        for n, k, b in zip(nll, tokens, sizes, strict=True)
    )
    by_tag: dict[str, list[TextScore]] = {}
    for doc, tag in zip(documents, tag_of, strict=True):
        if tag is not None:
            by_tag.setdefault(tag, []).append(doc)
    total = _sum(documents)
    return EvalResult(
        nll=total.nll,
        tokens=total.tokens,
        bytes=total.bytes,
        seq_len=seq_len,
        stride=stride,
        windows=num_windows,
        documents=documents,
        tags=types.MappingProxyType({t: _sum(d) for t, d in by_tag.items()}),
    )


def _sum(scores: Sequence[TextScore]) -> TextScore:
    """The score of several texts together (NLL, tokens and bytes summed)."""
    return TextScore(
        float(math.fsum(s.nll for s in scores)),
        sum(s.tokens for s in scores),
        sum(s.bytes for s in scores),
    )


def _windows(lengths: Sequence[int], seq_len: int, stride: int) -> dict[str, Any]:
    """Every window of every document that scores a token, as arrays: its
    document, its first token `begin`, its length, and the rows of its logits
    that score a token (`first_row` and `count`: logit row r scores token
    r + 1 of the window)."""
    doc, begin, length, first, count = [], [], [], [], []
    for d, n in enumerate(lengths):
        # The guide's loop: begins 0, s, 2s, ... until a window reaches n.
        last = max(0, -(-(n - seq_len) // stride))
        b = np.arange(last + 1) * stride
        e = np.minimum(b + seq_len, n)
        prev = np.concatenate([[0], e[:-1]])
        scored_from = np.maximum(prev, b + 1)  # the first token scored
        # a last window of one token with stride = seq_len scores nothing
        keep = e > scored_from
        b, e, scored_from = b[keep], e[keep], scored_from[keep]
        doc.append(np.full(len(b), d))
        begin.append(b)
        length.append(e - b)
        first.append(scored_from - b - 1)
        count.append(e - scored_from)
    cat = np.concatenate
    return {
        "doc": cat(doc),
        "begin": cat(begin),
        "length": cat(length),
        "first_row": cat(first),
        "count": cat(count),
    }


def _merge_first_windows(
    windows: Mapping[str, np.ndarray], rows: int, batch_size: int
) -> Mapping[str, np.ndarray]:
    """The windows to run, each scoring at most `rows` tokens when that costs
    fewer model calls.

    A document's first window scores up to `seq_len - 1` tokens, the others
    at most `rows` (= the stride): run apart, the first windows are a second
    compiled program whose batches are padded (one document: one window in a
    batch of `batch_size`). Cut into parts of at most `rows` scored tokens
    (the same tokens in, other rows scored), they join the others' batches.
    They are cut when that pads to fewer window calls in all; ties too (one
    program less to compile). The scores are the same: each part sums its
    own rows, and the parts add up per document.
    """
    count = windows["count"]
    first = count > rows
    if not first.any():
        return windows

    def padded(n):
        return -(-n // batch_size) * batch_size

    parts = -(-count[first] // rows)
    apart = padded(int((~first).sum())) + padded(int(first.sum()))
    if padded(int((~first).sum()) + int(parts.sum())) > apart:
        return windows
    times = np.where(first, -(-count // rows), 1)
    cut = {k: np.repeat(v, times) for k, v in windows.items()}
    # part k of a window scores rows first_row + k * rows onwards
    k = np.arange(len(cut["count"])) - np.repeat(np.cumsum(times) - times, times)
    cut["first_row"] = cut["first_row"] + k * rows
    cut["count"] = np.minimum(rows, cut["count"] - k * rows)
    return cut


def _batch(
    ids: Sequence[np.ndarray],
    windows: Mapping[str, np.ndarray],
    part: np.ndarray,
    seq_len: int,
    rows: int,
    batch_size: int,
) -> tuple[np.ndarray, ...]:
    """The model inputs of windows `part`, padded to `batch_size` windows of
    `seq_len` tokens, and for each the `rows` logit rows to score (`offset`
    onwards), their target ids and which of them count."""
    tokens = np.zeros((batch_size, seq_len), np.int32)
    targets = np.zeros((batch_size, rows), np.int32)
    offset = np.zeros((batch_size,), np.int32)
    mask = np.zeros((batch_size, rows), bool)
    for j, w in enumerate(part):
        b, n = windows["begin"][w], windows["length"][w]
        first, count = windows["first_row"][w], windows["count"][w]
        window = ids[windows["doc"][w]][b : b + n]
        tokens[j, :n] = window
        # the scored rows first..first+count-1 sit at the end of the slice
        offset[j] = max(0, first + count - rows)
        r = offset[j] + np.arange(rows)
        scored = (r >= first) & (r < first + count)
        targets[j, scored] = window[r[scored] + 1]
        mask[j] = scored
    return tokens, offset, targets, mask


@eqx.filter_jit
def _window_nll(
    model: eqx.Module,
    tokens: Int[Array, "B T"],
    offset: Int[Array, " B"],
    targets: Int[Array, "B K"],
    mask: Bool[Array, "B K"],
    chunk: int,
) -> Float[Array, " B"]:
    """Each window's summed NLL over its scored rows (float32 log-softmax).

    The head runs on `chunk` rows of every window at a time (a `lax.map`), so
    that at most `B x chunk x vocab` logits exist at once."""
    B, K = targets.shape
    rows = offset[:, None] + jnp.arange(K)

    def score(logits, targets, mask):
        nll = token_cross_entropy(logits, targets, _owner=_OWNER)
        return jnp.sum(jnp.where(mask, nll, 0.0), axis=1)

    if not isinstance(model, DecoderLM):  # a CharLM: full logits, then the rows
        logits = jnp.take_along_axis(model(tokens), rows[..., None], axis=1)
        return score(logits, targets, mask)
    # only the scored rows reach the head
    h = jnp.take_along_axis(model.hidden(tokens), rows[..., None], axis=1)
    size = min(K, chunk)
    n = -(-K // size)
    if n == 1:
        return score(model.logits(h), targets, mask)
    pad = n * size - K

    def split(x):  # (B, K, ...) -> (n, B, size, ...), padded rows masked
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, size, *x.shape[2:]), 1, 0)

    parts = jax.lax.map(
        lambda a: score(model.logits(a[0]), a[1], a[2]),
        (split(h), split(targets), split(mask)),
    )
    return jnp.sum(parts, axis=0)


def _tags(tags: Any, count: int) -> list[str | None]:
    """One tag (a str, or None) per text."""
    if tags is None:
        return [None] * count
    if isinstance(tags, str) or not isinstance(tags, (list, tuple)):
        raise ConfigError(
            f"{_OWNER}: tags must be a list with one tag (str or None) per text, "
            f"got {tags!r:.60} of type {type(tags).__name__}."
        )
    if len(tags) != count:
        raise ConfigError(
            f"{_OWNER}: tags has {len(tags)} entries for {count} texts; give one "
            "tag (str, or None for none) per text."
        )
    for i, tag in enumerate(tags):
        if tag is not None and not (isinstance(tag, str) and tag):
            raise ConfigError(
                f"{_OWNER}: tags[{i}] must be a non-empty str or None, got {tag!r}."
            )
    return list(tags)


def _encode(tokenizer: Any, text: str, name: str, vocab: int) -> np.ndarray:
    """`tokenizer.encode(text)`: at least 2 int32 ids in `[0, vocab)`."""
    if not text:
        raise ConfigError(f"{_OWNER}: {name} is empty; give at least one character.")
    ids = np.asarray(tokenizer.encode(text))
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise ConfigError(
            f"{_OWNER}: tokenizer.encode({name}) must give a list of int token "
            f"ids, got dtype {ids.dtype}, shape {ids.shape}."
        )
    if ids.size < 2:
        raise ConfigError(
            f"{_OWNER}: {name} encodes to {ids.size} token(s); at least 2 are "
            "needed (a document's first token is context only, so nothing "
            f"would be scored). Text: {text!r:.60}"
        )
    return check_ids_in_vocab(_OWNER, f"tokenizer.encode({name})", ids, vocab)
