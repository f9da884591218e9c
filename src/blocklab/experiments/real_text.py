r"""Real text: a byte-level BPE model against a character model, in bits per byte.

The study trains, on the shipped corpus (H. G. Wells, *The Time Machine*,
179 kB of ASCII), two language models of one parameter count for one step
budget, every seed of each as one `blocklab.train_sweep`, and compares them
on held-out text in the one unit that does not depend on the tokenizer:
bits per byte.

**Data.** The corpus is split at a paragraph break: the first
$1 - $ `val_fraction` of it trains, the rest validates (the text of neither
is seen by the other's side: the tokenizer is trained on the training part
only). Both models read the training text through the token pipeline:
`blocklab.data.tokenize_files` writes each tokenizer's ids once to a
memory-mapped token folder, and `blocklab.data.TokenPipeline` serves packed,
shuffled windows of `seq_len + 1` tokens (one epoch holds every window once).

**Models.**

- *BPE*: a byte-level BPE tokenizer of `bpe_vocab` ids trained with the
  `tokenizers` library (GPT-2's pre-tokenizer and decoder, the 256 byte
  symbols, one special token `<|endoftext|>` that begins and ends each
  document), and a Llama-style `DecoderLM` (`DecoderConfig.llama`: RMSNorm,
  SwiGLU, RoPE, grouped-query attention, untied head).
- *Char*: `blocklab.models.CharLM` (learned positions, tied head) on bytes
  (`ByteTokenizer`: 256 byte ids and one id, 256, for the document
  boundary; the corpus is ASCII, so a byte is a character), as deep and with
  as many heads as the BPE model, its width the multiple of the head count
  whose total parameter count is closest to the BPE model's
  (`matched_width`).

Both train for `steps` steps of `batch_size` sequences of `seq_len` tokens
(so for the same number of token positions, and about the same FLOPs,
$6 N$ per token for $N$ parameters), with Adam, a linear warm-up and a
cosine decay to a tenth of `learning_rate`. A BPE token covers several
bytes, so the BPE model reads that many times more text in that budget: the
comparison is at matched parameters and compute, not at matched text.

**Bits per byte.** With $\ell_i = -\ln p(t_i \mid t_{<i})$ the loss (nats)
of token $i$ of a text of $B$ UTF-8 bytes that tokenizes to $t_0 t_1 \ldots
t_n$ ($t_0$ the document's `<|endoftext|>`, context only), the model's code
length for the text is $\sum_{i=1}^{n} \ell_i / \ln 2$ bits, and
$$\text{bpb} = \frac{\sum_{i=1}^{n} \ell_i}{B \ln 2}
= \frac{\bar\ell \, n}{B \ln 2}$$
(`bits_per_byte`: $\bar\ell$ the mean token loss, $n$ the scored tokens).
It is the same for both tokenizations of one text, where the loss per token
is not ($n / B$ is about 1 for bytes and about 1/3 here for BPE). A model
that knows nothing (uniform over $V$ ids) has $\bar\ell = \ln V$ and bpb
$= (n/B) \log_2 V$: 8.0 for bytes, $\log_2 257 = 8.006$ with the boundary
id.

During training (the curve of the figure) the validation text is scored
in disjoint windows of `seq_len` predicted tokens (every token once, each
with the context of its window); at the end `blocklab.evaluate_text` scores
it with a sliding window of stride `seq_len / 2` (each token with at least
half a window of context).

**Text out.** The first seed's BPE model and its tokenizer are saved as one
checkpoint folder (`save_pretrained`, then `tokenizer.json` and
`tokenizer_config.json`), read back with `load_pretrained` and
`load_tokenizer`, and continue `prompt` greedily
(`blocklab.generate_text`). With `transformers` installed (an optional
path, imported only there), the same folder is read by
`AutoModelForCausalLM` and `AutoTokenizer`, and its greedy `generate` gives
the same ids and text.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._io import atomic_dir, atomic_write
from .._validate import ConfigError, check_bool, check_float, check_int
from ..data import TokenPipeline, load_tokenizer, tokenize_files
from ..data.datasets import corpus_path
from ..diagnostics.counting import count_params
from ..interop import load_pretrained, save_pretrained
from ..models import CharLM, DecoderConfig, DecoderLM
from ..models.generation import generate
from ..text import evaluate_text, generate_text
from ..training.losses import token_cross_entropy
from ..training.run_config import RunConfig, SweepConfig
from ..training.sweep import train_sweep
from ._render import figure_links, json_floats, markdown_table
from ._seeds import check_seeds
from .protocol import check_protocol, report_estimate_hook, report_section_hook

__all__ = [
    "CPU",
    "EOT",
    "FULL",
    "MODELS",
    "PROTOCOLS",
    "QUICK",
    "ByteTokenizer",
    "RealTextProtocol",
    "RealTextResult",
    "bits_per_byte",
    "matched_width",
    "report_estimate",
    "report_section",
    "run_real_text",
    "save_folder",
    "split_corpus",
    "train_bpe",
    "transformers_greedy",
    "validation_windows",
    "write_tokenizer",
]

#: The special token that begins and ends every document of the BPE tokenizer.
EOT = "<|endoftext|>"
#: The two models, in the order of the tables and the figure.
MODELS = ("bpe", "char")
_LABELS = {"bpe": "BPE + Llama-style DecoderLM", "char": "bytes + CharLM"}


# Bits per byte --------------------------------------------------------------


def bits_per_byte(mean_loss: Any, num_tokens: int, num_bytes: int) -> Any:
    r"""$\bar\ell \, n / (B \ln 2)$: a mean token loss $\bar\ell$ (nats) over
    $n$ scored tokens of a text of $B$ UTF-8 bytes, in bits per byte.

    Works elementwise on arrays of mean losses (one per seed, per step).
    """
    n = check_int("bits_per_byte", "num_tokens", num_tokens, min=1)
    B = check_int("bits_per_byte", "num_bytes", num_bytes, min=1)
    return np.asarray(mean_loss, np.float64) * n / (B * math.log(2.0))


# Tokenizers -----------------------------------------------------------------


class ByteTokenizer:
    """The character model's tokenizer: a text's UTF-8 bytes as ids 0..255,
    after the document boundary id 256 (`eos_id`, also `bos_id`), as the BPE
    tokenizer begins a document with `<|endoftext|>`.

    It has what `tokenize_files`, `evaluate_text` and `generate_text` use:
    `encode`, `decode`, `eos_id`, `vocab_size`.
    """

    vocab_size = 257
    eos_id = 256
    bos_id = 256

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """`[256]` (with `add_special_tokens`) followed by the bytes of `text`."""
        if not isinstance(text, str):
            raise ConfigError(
                f"ByteTokenizer.encode: text must be a str, got {type(text).__name__}."
            )
        head = [self.bos_id] if add_special_tokens else []
        return head + list(text.encode("utf-8"))

    def decode(self, ids: Any) -> str:
        """The text of the byte ids (the boundary id and anything above
        dropped; an incomplete UTF-8 sequence as U+FFFD)."""
        values = np.asarray(ids, np.int64).reshape(-1)
        data = bytes(int(i) for i in values if 0 <= i < 256)
        return data.decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


def train_bpe(
    text: str | Sequence[str],
    vocab_size: int,
    *,
    special_tokens: Sequence[str] = (EOT,),
    bos: str | None = EOT,
) -> Any:
    """A byte-level BPE `tokenizers.Tokenizer` of `vocab_size` ids trained on
    `text` (one string, or several trained on together): GPT-2's byte-level
    pre-tokenizer (no prefix space) and decoder, the 256 byte symbols,
    `special_tokens` (by default `EOT`, id 0) as its first ids, and a
    post-processor that begins every text with `bos` (`None`: none)."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )

    vocab_size = check_int("train_bpe", "vocab_size", vocab_size, min=257)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([text] if isinstance(text, str) else list(text), trainer)
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, tok.token_to_id(bos))]
        )
    return tok


def split_corpus(text: str, val_fraction: float) -> tuple[str, str]:
    """(train, validation): `text` cut at the paragraph break (a blank line)
    nearest to `1 - val_fraction` of its length."""
    check_float("split_corpus", "val_fraction", val_fraction, min=0.0, max=0.5,
                min_open=True)  # fmt: skip
    at = int(len(text) * (1.0 - val_fraction))
    breaks = [i for i in (text.rfind("\n\n", 0, at), text.find("\n\n", at)) if i > 0]
    cut = min(breaks, key=lambda i: abs(i - at)) + 2 if breaks else at
    return text[:cut], text[cut:]


def save_folder(model: DecoderLM, tokenizer: Any, path: str | Path, *,
                overwrite: bool = False) -> Path:  # fmt: skip
    """One checkpoint folder for `model` and its BPE `tokenizer` (a
    `tokenizers.Tokenizer` from `train_bpe`): `save_pretrained`'s files (BOS
    and EOS = `EOT`) and `write_tokenizer`'s, which `blocklab.load_tokenizer`
    and `transformers.AutoTokenizer` read. Written atomically."""
    eot = tokenizer.token_to_id(EOT)
    with atomic_dir(path, owner="save_folder", overwrite=overwrite) as tmp:
        save_pretrained(
            model, tmp, overwrite=True,
            token_ids={"bos_token_id": eot, "eos_token_id": eot},
        )  # fmt: skip
        write_tokenizer(tokenizer, tmp, max_len=model.cfg.max_len)
    return Path(path)


def write_tokenizer(tokenizer: Any, folder: str | Path, *, max_len: int) -> None:
    """`tokenizer.json` (the `tokenizers.Tokenizer`) and a
    `tokenizer_config.json` naming `EOT` as BOS and EOS into `folder`."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "model_max_length": max_len,
        "clean_up_tokenization_spaces": False,
    }
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write(folder / "tokenizer.json", tokenizer.to_str(), owner="write_tokenizer")
    atomic_write(folder / "tokenizer_config.json", _json(config),
                 owner="write_tokenizer")  # fmt: skip


def _json(obj: Any) -> str:
    import json

    return json.dumps(obj, indent=2) + "\n"


# Protocol -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RealTextProtocol:
    """The sizes of the study.

    Attributes:
        name: how reports name it.
        steps: optimizer steps of every model (the step budget).
        seeds: the model seeds (the members of each sweep; the pipeline's
            order is one for all of them: `train_sweep` gives every member
            the same host batches, so the seeds vary the initialization).
        bpe_vocab: ids of the BPE tokenizer (>= 257: bytes and `EOT`).
        num_hiddens, num_heads, num_kv_heads, num_blks: the BPE model
            (`DecoderConfig.llama`); the CharLM has `num_blks` and
            `num_heads` and the matched width.
        seq_len, batch_size: tokens per sequence and sequences per step, for
            both models.
        learning_rate, warmup_steps: Adam, a linear warm-up to
            `learning_rate`, then a cosine decay to a tenth of it.
        val_fraction: the share of the corpus held out (cut at a paragraph).
        prompt, new_tokens: the greedy continuation of the saved model.
        steps_per_call: training steps per compiled call (the curve's period).
        sliding_eval: score the final models with `evaluate_text` (a sliding
            window of stride `seq_len / 2`); `False`: the final figure is the
            curve's last point (disjoint windows), which saves compiling it.
        text_out: save the first seed's BPE model with its tokenizer, read
            it back and continue `prompt` (and compare with `transformers`).
    """

    name: str
    steps: int
    seeds: tuple[int, ...] = (0, 1, 2)
    bpe_vocab: int = 512
    num_hiddens: int = 64
    num_heads: int = 4
    num_kv_heads: int = 2
    num_blks: int = 2
    seq_len: int = 64
    batch_size: int = 32
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    val_fraction: float = 0.1
    prompt: str = "The Time Traveller"
    new_tokens: int = 24
    steps_per_call: int = 50
    sliding_eval: bool = True
    text_out: bool = True

    def __post_init__(self) -> None:
        owner = "RealTextProtocol"
        object.__setattr__(self, "seeds", check_seeds(self.seeds, _owner=owner))
        ints = dict(steps=1, bpe_vocab=257, num_hiddens=1, num_heads=1,
                    num_kv_heads=1, num_blks=1, seq_len=2, batch_size=1,
                    warmup_steps=0, new_tokens=1, steps_per_call=1)  # fmt: skip
        for name, lo in ints.items():
            object.__setattr__(
                self, name, check_int(owner, name, getattr(self, name), min=lo)
            )
        if (
            self.num_hiddens % self.num_heads
            or (self.num_hiddens // self.num_heads) % 2
        ):
            raise ConfigError(
                f"{owner}: num_hiddens={self.num_hiddens} must be a multiple of "
                f"num_heads={self.num_heads} with an even head size (RoPE)."
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"{owner}: num_heads={self.num_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}."
            )
        for name in ("sliding_eval", "text_out"):
            object.__setattr__(self, name, check_bool(owner, name, getattr(self, name)))
        check_float(owner, "learning_rate", self.learning_rate, min=0.0, min_open=True)
        check_float(owner, "val_fraction", self.val_fraction, min=0.0, max=0.5,
                    min_open=True)  # fmt: skip
        if not isinstance(self.prompt, str) or not self.prompt:
            raise ConfigError(f"{owner}: prompt must be a non-empty str.")

    def replace(self, **changes: Any) -> RealTextProtocol:
        return dataclasses.replace(self, **changes)

    @property
    def config(self) -> DecoderConfig:
        """The BPE model's `DecoderConfig` (Llama family)."""
        return DecoderConfig.llama(
            self.bpe_vocab, self.num_hiddens, self.num_heads, self.num_blks,
            num_kv_heads=self.num_kv_heads, max_len=self.seq_len,
        )  # fmt: skip

    def char_model(self, width: int, *, key: PRNGKeyArray) -> CharLM:
        """The character model at `width` (SwiGLU, pre-norm RMSNorm)."""
        return CharLM(
            ByteTokenizer.vocab_size, width, self.num_heads, self.num_blks,
            max_len=self.seq_len, key=key,
        )  # fmt: skip


#: The report's (`blocklab report`): two seeds, 100 steps, the curve's last
#: point as the final figure and no text out; about 20 s on 2 CPU cores,
#: most of it compiling the two sweeps.
QUICK = RealTextProtocol(
    "quick", 100, seeds=(0, 1), batch_size=16, warmup_steps=20, steps_per_call=20,
    sliding_eval=False, text_out=False,
)  # fmt: skip
#: `blocklab real-text` (the default): three seeds, 1500 steps of 32 x 64
#: tokens (40 epochs of the BPE model's 77k training tokens, 19 of the
#: bytes'); 330 CPU seconds. The BPE model leads until about step 600, is at
#: its best near step 450 (2.52 bits per byte) and then overfits (3.14 at
#: the end); the byte model reaches 2.46 and keeps it.
CPU = RealTextProtocol("cpu", 1500, steps_per_call=100)
#: On an accelerator: wider models, a larger vocabulary, eight seeds.
FULL = CPU.replace(
    name="full", steps=4000, seeds=tuple(range(8)), bpe_vocab=2048,
    num_hiddens=256, num_heads=8, num_kv_heads=4, num_blks=4, seq_len=128,
    batch_size=64, learning_rate=1e-3, warmup_steps=200, steps_per_call=250,
)  # fmt: skip
PROTOCOLS = {p.name: p for p in (QUICK, CPU, FULL)}


def matched_width(protocol: RealTextProtocol) -> tuple[int, int, int]:
    """The CharLM width (a multiple of `num_heads`) whose parameter count is
    closest to the BPE model's; returns `(width, char_params, bpe_params)`.

    Counted on abstract models (`eqx.filter_eval_shape`: nothing allocated);
    the count grows with the width, so a bisection finds it.
    """
    p = protocol
    key = jax.random.key(0)
    bpe = count_params(eqx.filter_eval_shape(DecoderLM, p.config, key=key))

    def char(width):
        return count_params(eqx.filter_eval_shape(p.char_model, width, key=key))

    lo, hi = 1, 1
    while char(hi * p.num_heads) < bpe:
        lo, hi = hi, 2 * hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if char(mid * p.num_heads) < bpe else (lo, mid)
    best = min((lo, hi), key=lambda m: abs(char(m * p.num_heads) - bpe))
    width = best * p.num_heads
    return width, char(width), bpe


@functools.cache
def _optimizer(warmup_steps: int, steps: int) -> optax.GradientTransformationExtraArgs:
    # One object per schedule, so repeated runs reuse the compiled step.
    warmup = float(max(warmup_steps, 1))
    decay = float(max(steps - warmup_steps, 1))

    def adam(learning_rate):
        def rate(t):
            up = jnp.minimum(1.0, (t + 1) / warmup)
            done = jnp.clip((t - warmup_steps) / decay, 0.0, 1.0)
            return learning_rate * up * (0.1 + 0.45 * (1 + jnp.cos(jnp.pi * done)))

        return optax.adam(rate)

    return optax.inject_hyperparams(adam, hyperparam_dtype=jnp.float32)(
        learning_rate=1.0
    )


# Validation -----------------------------------------------------------------


def validation_windows(
    ids: Sequence[int] | Int[np.ndarray, " N"], seq_len: int
) -> tuple[Int[np.ndarray, "W T"], Int[np.ndarray, "W T"], Float[np.ndarray, "W T"]]:
    r"""Disjoint windows of the ids $t_0 \ldots t_n$: inputs $X$, targets $Y$
    and a mask, `(W, seq_len)` each with $W = \lceil n / \text{seq\_len}
    \rceil$. Window $w$ predicts $t_{wL+1} \ldots t_{wL+L}$ ($L$ = `seq_len`)
    from $t_{wL} \ldots t_{wL+L-1}$; the last one is padded (mask 0), so
    every token $t_1 \ldots t_n$ is a target exactly once."""
    L = check_int("validation_windows", "seq_len", seq_len, min=1)
    t = np.asarray(ids, np.int32)
    n = t.size - 1
    if n < 1:
        raise ConfigError("validation_windows: ids must hold at least 2 tokens.")
    W = -(-n // L)
    at = np.arange(W)[:, None] * L + np.arange(L + 1)
    inside = at <= n
    windows = np.where(inside, t[np.minimum(at, n)], 0)
    return windows[:, :-1], windows[:, 1:], inside[:, 1:].astype(np.float32)


class _ValidationProbe(eqx.Module):
    """`probe(model)`: the summed loss (nats) of the validation targets, the
    windows `chunk` at a time (a `lax.map` over chunks of one batched call)."""

    X: Int[Array, "C N T"]
    Y: Int[Array, "C N T"]
    mask: Float[Array, "C N T"]

    def __init__(self, X, Y, mask, chunk: int = 32):
        W = X.shape[0]
        C = -(-W // chunk)
        pad = C * chunk - W

        def split(a):
            a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), a.dtype)])
            return jnp.asarray(a.reshape(C, chunk, *a.shape[1:]))

        self.X, self.Y, self.mask = split(X), split(Y), split(mask)

    def __call__(self, model: Any) -> Float[Array, ""]:
        def one(x, y, m):
            nll = token_cross_entropy(model(x), y, _owner="real_text")
            return jnp.sum(nll * m)

        return jnp.sum(jax.lax.map(lambda a: one(*a), (self.X, self.Y, self.mask)))


# Result ---------------------------------------------------------------------


def _mean_sd(x: Any) -> tuple[float, float]:
    x = np.asarray(x, np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    return float(np.mean(x)), float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def _fmt(x: Any, digits: int = 3) -> str:
    m, s = _mean_sd(x)
    if not math.isfinite(m):
        return "–"
    return f"{m:.{digits}f} ± {s:.{digits}f}"


def _per_seed(x: Any, digits: int = 3) -> str:
    return ", ".join(
        f"{v:.{digits}f}" if math.isfinite(v) else "–"
        for v in np.asarray(x, np.float64).ravel()
    )


@dataclasses.dataclass(frozen=True)
class RealTextResult:
    """What `run_real_text` returns (per model in `MODELS`, per seed `k`).

    Attributes:
        protocol: the protocol run.
        char_width: the CharLM's matched width.
        params: parameter count by model.
        val_bytes: UTF-8 bytes of the validation text $B$.
        val_tokens: validation tokens scored $n$, by model.
        train_tokens: training tokens (EOT included), by model.
        bytes_per_token: training-text bytes per token, by model.
        probe_steps: `(R,)` the steps at which the curve was taken.
        curve: `(K, R)` validation bits per byte (disjoint windows), by model.
        train_losses: `(K, steps)` training loss (nats per token), by model.
        val_bpb: `(K,)` final validation bits per byte (`evaluate_text`,
            stride `seq_len / 2`; the curve's last point without
            `sliding_eval`), by model.
        val_loss: `(K,)` the same as a mean loss per token (nats), by model.
        greedy: the first seed's BPE model's greedy continuation of the
            prompt, read back from the saved folder (`None` without
            `text_out`).
        transformers_text: the same folder's greedy text in `transformers`
            (`None` when not checked: see `transformers_note`).
        transformers_same: whether the ids and the text are equal (`None`
            when not checked).
        transformers_note: why the check was skipped, or `""`.
        folder: where the model and tokenizer were saved (`None`: a temporary
            folder, removed).
        seconds: wall time by phase.
    """

    protocol: RealTextProtocol
    char_width: int
    params: dict[str, int]
    val_bytes: int
    val_tokens: dict[str, int]
    train_tokens: dict[str, int]
    bytes_per_token: dict[str, float]
    probe_steps: np.ndarray
    curve: dict[str, np.ndarray]
    train_losses: dict[str, np.ndarray]
    val_bpb: dict[str, np.ndarray]
    val_loss: dict[str, np.ndarray]
    greedy: str | None
    transformers_text: str | None
    transformers_same: bool | None
    transformers_note: str
    folder: str | None
    seconds: dict[str, float]

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.protocol.seeds

    def epochs(self, model: str) -> float:
        """Passes over the model's training tokens in the step budget
        (`steps x batch_size x seq_len` predicted tokens)."""
        p = self.protocol
        return p.steps * p.batch_size * p.seq_len / self.train_tokens[model]

    def best(self, model: str) -> tuple[np.ndarray, int]:
        """The curve's lowest point (mean over the seeds): `(K,)` bits per
        byte there, and its step (the model overfits after it when it comes
        before the last step)."""
        i = int(np.nanargmin(np.nanmean(self.curve[model], axis=0)))
        return self.curve[model][:, i], int(self.probe_steps[i])

    def table(self) -> str:
        """Markdown: per model its size, tokens and the final bits per byte."""
        header = ["model", "parameters", "bytes / token", "epochs",
                  "val loss (nats/token)", "val bits per byte",
                  f"per seed {list(self.seeds)}", "curve's best (step)"]  # fmt: skip
        body = []
        for m in MODELS:
            low, step = self.best(m)
            body.append(
                [_LABELS[m], f"{self.params[m]:,}", f"{self.bytes_per_token[m]:.2f}",
                 f"{self.epochs(m):.1f}", _fmt(self.val_loss[m]),
                 _fmt(self.val_bpb[m]), _per_seed(self.val_bpb[m]),
                 f"{_fmt(low)} ({step})"]
            )  # fmt: skip
        text = markdown_table(header, body, align="lrrrrrrr")
        if self.greedy is None:
            return text
        if self.transformers_same is None:
            check = f"`transformers` check: {self.transformers_note}"
        else:
            same = "equal" if self.transformers_same else "**different**"
            check = f"`transformers` greedy text from the same folder: {same}."
        return (
            f"{text}\n\nGreedy continuation of {self.protocol.prompt!r} by the saved "
            f"BPE model (seed {self.seeds[0]}): {self.greedy!r}. {check}"
        )

    def to_json(self) -> dict[str, Any]:
        summary = {}
        for m in MODELS:
            mb, sb = _mean_sd(self.val_bpb[m])
            summary[m] = {
                "params": self.params[m],
                "val_bits_per_byte": {"mean": json_floats(mb), "sd": json_floats(sb),
                                      "per_seed": json_floats(self.val_bpb[m])},
                "val_loss_per_token": json_floats(self.val_loss[m]),
                "val_tokens": self.val_tokens[m],
                "train_tokens": self.train_tokens[m],
                "bytes_per_token": self.bytes_per_token[m],
                "epochs": self.epochs(m),
                "best_on_curve": {"step": self.best(m)[1],
                                  "per_seed": json_floats(self.best(m)[0])},
            }  # fmt: skip
        return {
            "protocol": dataclasses.asdict(self.protocol),
            "seeds": list(self.seeds),
            "char_width": self.char_width,
            "val_bytes": self.val_bytes,
            "models": summary,
            "probe_steps": [int(s) for s in self.probe_steps],
            "curve_bits_per_byte": {m: json_floats(self.curve[m]) for m in MODELS},
            "train_losses": {m: json_floats(self.train_losses[m]) for m in MODELS},
            "greedy": self.greedy,
            "transformers_text": self.transformers_text,
            "transformers_same": self.transformers_same,
            "transformers_note": self.transformers_note,
            "folder": self.folder,
            "seconds": dict(self.seconds),
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`real_text_bpb.png`: validation bits per byte against the step,
        both models (mean over the seeds, band min-max)."""
        from .plotting import _save, plt

        fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
        x = self.probe_steps
        for m in MODELS:
            y = np.asarray(self.curve[m], np.float64)
            label = f"{_LABELS[m]} ({self.params[m]:,} parameters)"
            (line,) = ax.plot(x, np.nanmean(y, 0), marker=".", label=label)
            ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), alpha=0.2,
                            color=line.get_color())  # fmt: skip
        top = max(float(np.nanmax(np.where(np.isfinite(c), c, np.nan)))
                  for c in self.curve.values())  # fmt: skip
        ax.axhline(math.log2(ByteTokenizer.vocab_size), ls="--", c="gray", lw=1)
        ax.annotate(
            "uniform over the byte model's 257 ids", (0.35, 8.06),
            xycoords=("axes fraction", "data"), fontsize=7, c="gray",
        )  # fmt: skip
        ax.set_ylim(0.0, max(8.6, 1.05 * top) if math.isfinite(top) else 8.6)
        ax.set(xlabel="step", ylabel="validation bits per byte",
               title="held-out text, same parameters and steps")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.suptitle(f"seeds {list(self.seeds)}: mean, band min-max", fontsize=9)
        return [_save(fig, Path(out_dir) / "real_text_bpb.png")]


# The study ------------------------------------------------------------------


def transformers_greedy(folder: str | Path, prompt: str, new_tokens: int) -> list[int]:
    """The ids (prompt and continuation) that `transformers` generates
    greedily from the checkpoint folder (`AutoTokenizer`,
    `AutoModelForCausalLM`, `generate(do_sample=False)`). Imports
    `transformers` and torch: an optional path."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids, do_sample=False, max_new_tokens=new_tokens,
            attention_mask=torch.ones_like(ids),
        )  # fmt: skip
    return [int(i) for i in out[0]]


def _sweep(make, tokens, p, probe, progress):
    pipe = TokenPipeline(tokens, seq_len=p.seq_len, batch_size=p.batch_size,
                         seed=0, segment_ids=False)  # fmt: skip
    seeds = np.asarray(p.seeds, np.int64)
    return train_sweep(
        make, pipe, p.steps,
        model_keys=seeds, data_keys=seeds + 1000,
        run=RunConfig(steps_per_call=min(p.steps_per_call, p.steps),
                      progress=progress),
        sweep=SweepConfig(learning_rates=p.learning_rate,
                          optimizer=_optimizer(p.warmup_steps, p.steps),
                          probe=probe, validate=False),
    )  # fmt: skip


def run_real_text(
    protocol: RealTextProtocol = CPU,
    *,
    folder: str | Path | None = None,
    check_transformers: bool | None = None,
    progress: bool = False,
) -> RealTextResult:
    """Train both tokenizations' models over the seeds, score them in bits
    per byte, save and reload the BPE model with its tokenizer, and continue
    the prompt (in `transformers` too, when asked or installed).

    Args:
        protocol: a `RealTextProtocol` (`QUICK`, `CPU`, `FULL` or your own).
        folder: where to save the BPE model and tokenizer as one checkpoint
            folder (replaced if it exists); `None`: a temporary folder.
        check_transformers: load the folder in `transformers` and compare its
            greedy text; `None`: if `transformers` can be imported.
        progress: tqdm bars over the tokenization and the training chunks.

    Returns:
        A `RealTextResult`.
    """
    owner = "run_real_text"
    check_protocol(owner, protocol, RealTextProtocol, str(sorted(PROTOCOLS)))
    progress = check_bool(owner, "progress", progress)
    if check_transformers is not None:
        check_transformers = check_bool(owner, "check_transformers", check_transformers)
    p = protocol
    seconds: dict[str, float] = {}
    text = corpus_path().read_text(encoding="utf-8")
    train_text, val_text = split_corpus(text, p.val_fraction)
    val_bytes = len(val_text.encode("utf-8"))

    with tempfile.TemporaryDirectory(prefix="blocklab-real-text-") as tmp_name:
        tmp = Path(tmp_name)
        t0 = time.perf_counter()
        bpe = train_bpe(train_text, p.bpe_vocab)
        write_tokenizer(bpe, tmp / "tokenizer", max_len=p.seq_len)
        tokenizers = {"bpe": load_tokenizer(tmp / "tokenizer"), "char": ByteTokenizer()}
        (tmp / "train.txt").write_text(train_text, encoding="utf-8")
        files = {
            m: tokenize_files(tmp / "train.txt", tok, tmp / f"tokens_{m}",
                              progress=progress)
            for m, tok in tokenizers.items()
        }  # fmt: skip
        seconds["tokenize"] = time.perf_counter() - t0

        width, char_params, bpe_params = matched_width(p)
        makers = {
            "bpe": lambda key: DecoderLM(p.config, key=key),
            "char": lambda key: p.char_model(width, key=key),
        }
        curve, train_losses, models, val_tokens = {}, {}, {}, {}
        for m in MODELS:
            ids = tokenizers[m].encode(val_text)
            val_tokens[m] = len(ids) - 1
            X, Y, mask = validation_windows(ids, p.seq_len)
            t0 = time.perf_counter()
            probe = _ValidationProbe(X, Y, mask)
            sweep = _sweep(makers[m], files[m], p, probe, progress)
            seconds[f"train_{m}"] = time.perf_counter() - t0
            summed = np.asarray(sweep.probes, np.float64)  # (K, R) nats
            curve[m] = summed / (val_bytes * math.log(2.0))
            train_losses[m] = np.asarray(sweep.losses, np.float64)
            models[m] = sweep.state.model
            probe_steps = np.asarray(sweep.probe_steps)

        t0 = time.perf_counter()
        stride = max(1, p.seq_len // 2)
        val_bpb, val_loss = {}, {}
        for m in MODELS:
            if not p.sliding_eval:
                val_bpb[m] = curve[m][:, -1]
                val_loss[m] = val_bpb[m] * val_bytes * math.log(2.0) / val_tokens[m]
                continue
            scores = [
                evaluate_text(_member(models[m], k), tokenizers[m], val_text,
                              seq_len=p.seq_len, stride=stride, batch_size=16)
                for k in range(len(p.seeds))
            ]  # fmt: skip
            val_bpb[m] = np.array([s.bits_per_byte for s in scores])
            val_loss[m] = np.array([s.nll / s.tokens for s in scores])
        seconds["evaluate"] = time.perf_counter() - t0

        hf_text, same, note, greedy, saved = None, None, "", None, None
        if p.text_out:
            t0 = time.perf_counter()
            saved = Path(folder) if folder is not None else tmp / "model"
            save_folder(_member(models["bpe"], 0), bpe, saved, overwrite=True)
            model = load_pretrained(saved)
            tokenizer = load_tokenizer(saved)
            greedy = generate_text(model, tokenizer, p.prompt, p.new_tokens)
            seconds["save_generate"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        if not p.text_out:
            note = f"not run (protocol {p.name!r} has text_out=False)."
        elif check_transformers is False:
            note = "not run (check_transformers=False)."
        else:
            try:
                hf_ids = transformers_greedy(saved, p.prompt, p.new_tokens)
            except ImportError as err:
                if check_transformers:
                    raise
                note = f"not run: `transformers` is not installed ({err})."
            else:
                prompt_ids = np.asarray(tokenizer.encode(p.prompt), np.int32)
                ours = np.asarray(generate(model, prompt_ids, p.new_tokens)).tolist()
                hf_text = tokenizer.decode(hf_ids)
                same = _same_greedy(ours, hf_ids, tokenizer.stop_ids) and (
                    hf_text == greedy[: len(hf_text)]
                )
        seconds["transformers"] = time.perf_counter() - t0

        train_bytes = len(train_text.encode("utf-8"))
        return RealTextResult(
            protocol=p,
            char_width=width,
            params={"bpe": bpe_params, "char": char_params},
            val_bytes=val_bytes,
            val_tokens=val_tokens,
            train_tokens={m: files[m].num_tokens for m in MODELS},
            bytes_per_token={
                m: train_bytes / (files[m].num_tokens - 2) for m in MODELS
            },
            probe_steps=probe_steps,
            curve=curve,
            train_losses=train_losses,
            val_bpb=val_bpb,
            val_loss=val_loss,
            greedy=greedy,
            transformers_text=hf_text,
            transformers_same=same,
            transformers_note=note,
            folder=None if folder is None or saved is None else str(folder),
            seconds=seconds,
        )


def _same_greedy(ours: list[int], theirs: list[int], stops: Sequence[int]) -> bool:
    """Equal ids, where `transformers` may stop early at a stop id."""
    if len(theirs) == len(ours):
        return theirs == ours
    return (
        len(theirs) < len(ours)
        and theirs == ours[: len(theirs)]
        and theirs[-1] in stops
    )


def _member(models: Any, k: int) -> Any:
    return jax.tree_util.tree_map(lambda a: a[k] if eqx.is_array(a) else a, models)


# Report ---------------------------------------------------------------------


def report_protocol(*, quick: bool = False, full: bool = False) -> RealTextProtocol:
    """The report's protocol: `FULL` with `full`, else `QUICK`."""
    return FULL if full else QUICK


def estimate_seconds(protocol: RealTextProtocol) -> float:
    """Seconds on 2 idle CPU cores: compilation of the two sweeps, the
    evaluations and the generation (about 12 s), then the training steps,
    linear in steps x seeds x batch x tokens x width^2."""
    p = protocol
    work = p.steps * len(p.seeds) * p.batch_size * p.seq_len * p.num_hiddens**2
    return 12.0 + 2.5e-9 * work * p.num_blks


@report_estimate_hook("real_text")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores for the report's protocol."""
    return estimate_seconds(report_protocol(quick=quick, full=full))


@report_section_hook("real_text")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """The real-text section: byte-level BPE against bytes, in bits per byte."""
    p = report_protocol(quick=quick, full=full)
    res = run_real_text(p, progress=progress)
    paths = res.figures(out_dir)
    note = "" if full else (
        f"Protocol `{p.name}`, sized for the report on a CPU ({p.steps} steps, "
        f"{len(p.seeds)} seeds; both models are far from converged, and the "
        "final figure is the curve's last point). `blocklab real-text` runs the "
        "`cpu` protocol (1500 steps, three seeds, a sliding-window evaluation "
        "at the end), saves the BPE model with its tokenizer as one checkpoint "
        "folder and checks that `transformers` continues a prompt from it with "
        "the same greedy text as blocklab.\n\n"
    )  # fmt: skip
    m = p.config
    gap = _mean_sd(res.val_bpb["char"])[0] - _mean_sd(res.val_bpb["bpe"])[0]
    return (
        "## Real text: byte-level BPE against bytes, in bits per byte\n\n"
        f"{note}A byte-level BPE tokenizer of {p.bpe_vocab} ids trained on the "
        f"first {100 * (1 - p.val_fraction):.0f}% of the Time Machine text, and a "
        f"Llama-style DecoderLM ({m.num_blks} layers, d = {m.num_hiddens}, "
        f"{m.num_heads} heads on {p.num_kv_heads} kv heads) trained on it through "
        "the token pipeline, against a CharLM on bytes of the same depth and "
        f"about the same parameter count (d = {res.char_width}): {p.steps} steps "
        f"of {p.batch_size} x {p.seq_len} tokens for each, seeds {list(p.seeds)} "
        "as one vmapped sweep per model. Bits per byte on the held-out "
        f"{res.val_bytes:,} bytes are the summed token loss / (bytes x ln 2); "
        f"at the end the BPE model is {abs(gap):.2f} bits per byte "
        f"{'below' if gap >= 0 else 'above'} the byte model. A BPE token covers "
        f"about {res.bytes_per_token['bpe']:.1f} bytes, so in one step budget "
        "the BPE model reads that many times more text, and passes over its "
        f"fewer training tokens that many times more often ({res.epochs('bpe'):.1f} "
        f"epochs against {res.epochs('char'):.1f}): it leads early and overfits "
        "first on a corpus this small (the `cpu` protocol shows the curves "
        "cross). Mean ± sd over the seeds.\n\n"
        f"{res.table()}\n\n" + figure_links(paths) + "\n"
    )
