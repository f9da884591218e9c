r"""blocklab as a model of the lm-eval harness: `BlocklabLM`, named `"blocklab"`.

`lm-eval` (EleutherAI's lm-evaluation-harness, the optional extra
`blocklab[lm-eval]`) scores a model through three requests. `BlocklabLM`
answers them with a checkpoint folder read by `load_pretrained` and
`load_tokenizer` (no torch, no `transformers`), and tokenizes as the
harness's Hugging Face backend (`HFLM`, `--model hf`) does, so that the two
give the same scores for the same folder:

- `loglikelihood((context, continuation))`: $\sum_i \log p(c_i \mid x,
  c_{<i})$ over the continuation's tokens $c$ after the context's tokens
  $x$, and whether greedy decoding gives exactly $c$. The whitespace at the
  end of the context moves to the front of the continuation; `context +
  continuation` and the context are encoded on their own, and the
  continuation's tokens are those of the whole after the context's count
  (a token merged across the boundary counts as the continuation's). An
  empty context is the prefix token (`prefix_token_id`, else BOS, else EOS)
  unless the continuation starts with it. The scored input is the last
  `max_length + 1` tokens less the last one (left truncation).
- `loglikelihood_rolling((text,))`: the log-likelihood of the whole text
  after the prefix token, in disjoint windows of at most `max_length`
  tokens (`lm_eval.utils.get_rolling_token_windows`, context 1, then
  `make_disjoint_window`), each token predicted once.
- `generate_until((context, gen_kwargs))`: the continuation of the last
  `max_length - max_gen_toks` tokens of the context: `max_gen_toks` new
  tokens, greedy (or sampled with `do_sample=True`, `temperature`, `top_k`,
  `top_p`), cut after the first end token (the tokenizer's `stop_ids`),
  decoded without special tokens, and cut before the first of each stop
  string of `until` (the EOS text added to them).

A text is encoded with the folder's special tokens (BOS first where the
folder adds it), except where it already starts with the prefix token's text;
`add_bos_token=True` / `False` adds BOS to every text or to none.

Batching: the forward passes run `batch_size` rows at a time, each row
right-padded to a bucket length (a power of two from 16, at most
`max_length`); a batch short of rows is filled with dummy rows. So the
scoring program is compiled once per bucket, and `generate` once per bucket
and generation setting (`max_gen_toks`, greedy or sampled). Requests with
the same input tokens (the choices of a multiple-choice question whose
answers are one token) share one row.

Use: `register()` (or the first use of `BlocklabLM`) imports `lm_eval` and
names the model type `"blocklab"` in its registry; importing this module
does not import `lm_eval` (nor does `import blocklab`):

```python
import lm_eval
from blocklab.text.lm_eval import register

register()  # --model blocklab
results = lm_eval.simple_evaluate(
    model="blocklab",
    model_args="pretrained=path/to/folder,batch_size=8,dtype=bfloat16",
    tasks=["hellaswag"],
)
```

or `lm_eval.simple_evaluate(model=BlocklabLM(pretrained=model,
tokenizer=folder), ...)` for a `DecoderLM` in memory. From the shell,
`python -m blocklab.text.lm_eval` is lm-eval's command line (`lm_eval`)
with `"blocklab"` registered: `python -m blocklab.text.lm_eval --model
blocklab --model_args pretrained=PATH,batch_size=8 --tasks hellaswag`.

The model arguments (`--model_args k=v,...`; see `BlocklabLM`):
`pretrained` (the folder), `tokenizer` (another folder), `batch_size`,
`max_length` (default: the model's `max_len`), `max_gen_toks` (256),
`dtype` (`auto`, `float32`, `bfloat16`, ...), `device` (`cpu`, `cuda[:i]`,
`gpu[:i]`, `tpu[:i]`), `add_bos_token`, `prefix_token_id` and `seed`
(sampled generation).

What `HFLM` has that this does not: chat templates (`--apply_chat_template`
is refused by name), `batch_size=auto`, data parallelism across processes,
PEFT adapters and `think_end_token`.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from .._validate import ConfigError, check_bool, check_float, check_int
from ..data.tokenizer import Tokenizer, load_tokenizer
from ..interop.pretrained import load_pretrained
from ..models import DecoderLM
from ..models.decode_loop import GenerationConfig
from ..models.decoding import model_limits
from ..models.generation import generate

# `BlocklabLM` is made by `register` on first use (the module `__getattr__`).
__all__ = ["MODEL_NAME", "BlocklabLM", "main", "register"]  # noqa: F822

#: The name of the model type in lm-eval's registry (`--model blocklab`).
MODEL_NAME = "blocklab"

_OWNER = "BlocklabLM"
_log = logging.getLogger(__name__)
#: The smallest padded length of a scored or prompted row.
_MIN_BUCKET = 16
#: The `gen_kwargs` keys `generate_until` reads (the aliases of
#: `max_gen_toks` in lm-eval's priority order).
_MAX_TOKEN_KEYS = (
    "max_gen_toks",
    "max_new_tokens",
    "max_tokens",
    "max_completion_tokens",
)
_GEN_KEYS = ("until", "do_sample", "temperature", "top_k", "top_p", *_MAX_TOKEN_KEYS)
_MODEL_ARGS = (
    "pretrained",
    "tokenizer",
    "batch_size",
    "max_length",
    "max_gen_toks",
    "dtype",
    "device",
    "add_bos_token",
    "prefix_token_id",
    "seed",
)

_registered: type | None = None


def register() -> type:
    """Name `BlocklabLM` `"blocklab"` in lm-eval's model registry (once).

    Imports `lm_eval` (the first time); neither `import blocklab` nor
    importing this module does. Reading `BlocklabLM` calls it.

    Returns:
        The class `BlocklabLM`, a subclass of `lm_eval.api.model.LM`.

    Raises:
        ImportError: `lm-eval` is not installed (`pip install
            "blocklab[lm-eval]"`).
    """
    global _registered
    if _registered is None:
        try:
            # lm-eval fills its registry with its own models (lazily) only
            # while it is empty: fill it first, or "hf" would be unknown
            import lm_eval.models  # noqa: F401
            from lm_eval.api.model import LM
            from lm_eval.api.registry import register_model
        except ImportError as err:
            raise ImportError(
                "blocklab.text.lm_eval needs the lm-eval package: pip install "
                '"blocklab[lm-eval]" (or "lm-eval>=0.4.13").'
            ) from err
        cls = type(
            "BlocklabLM",
            (_BlocklabLM, LM),
            {"__module__": __name__, "__doc__": _BlocklabLM.__doc__},
        )
        _registered = register_model(MODEL_NAME)(cls)
    return _registered


def __getattr__(name: str) -> Any:
    # `BlocklabLM` subclasses lm-eval's `LM`: it is built on first use, so that
    # this module imports without lm-eval (its docs, its import checks).
    if name == "BlocklabLM":
        return register()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def main(argv: Sequence[str] | None = None) -> None:
    """lm-eval's command line (`lm_eval ...`) with `"blocklab"` registered.

    Args:
        argv: the arguments (default `sys.argv[1:]`), as `lm_eval` takes
            them: `--model blocklab --model_args pretrained=PATH,batch_size=8
            --tasks TASK ...`.
    """
    register()
    from lm_eval.__main__ import cli_evaluate

    if argv is None:
        cli_evaluate()
        return
    saved = sys.argv
    sys.argv = [saved[0] if saved else "lm_eval", *argv]  # what lm-eval parses
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


class _BlocklabLM:
    r"""A checkpoint folder as a model of lm-eval (`--model blocklab`).

    The three requests and how they are tokenized are described in the
    module `blocklab.text.lm_eval`: as the harness's Hugging Face backend
    (`HFLM`) does, with the forward passes batched, padded to bucket lengths
    and compiled once per bucket.

    Args:
        pretrained: a checkpoint folder (`load_pretrained`), or a
            `DecoderLM` (then `tokenizer` is required).
        tokenizer: the tokenizer's folder, or a `Tokenizer`
            (`load_tokenizer`); default: the folder `pretrained`.
        batch_size: rows per forward pass, >= 1 (an int, or its digits as
            lm-eval's command line passes it).
        max_length: the longest input in tokens, in `[2, max_len]` (the
            model's `max_len`, `max_position_embeddings` of the folder,
            is the default, as `HFLM` reads it).
        max_gen_toks: the new tokens of `generate_until` when `gen_kwargs`
            give none (256, as `HFLM`).
        dtype: the parameters' dtype (`"float32"`, `"bfloat16"`, ...), or
            `None` / `"auto"` for the stored dtypes; for a folder only.
        device: where the model runs: `None` (JAX's default device),
            `"cpu"`, `"gpu"` / `"cuda"`, `"tpu"`, optionally with `:index`;
            a platform JAX does not have here is its default device (as
            `HFLM` falls back to the CPU: the command line passes
            `"cuda:0"` unless told otherwise).
        add_bos_token: `None` adds BOS where the folder's tokenizer adds it;
            `True` adds it to every text, `False` to none (as `HFLM`'s
            argument of that name).
        prefix_token_id: the token an empty context (and a rolling text)
            starts from; default BOS, else EOS.
        seed: the seed of the draws of `generate_until` with
            `do_sample=True` (each batch folds its index into it).

    Raises:
        ConfigError: naming the argument: an unknown model argument, a bad
            value, `batch_size="auto"`, a `dtype` with a model given, a
            tokenizer larger than the model's vocabulary, or a tokenizer
            without EOS.
    """

    def __init__(
        self,
        pretrained: str | os.PathLike | DecoderLM,
        tokenizer: str | os.PathLike | Tokenizer | None = None,
        batch_size: int | str = 1,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        dtype: Any = None,
        device: str | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        seed: int = 0,
        **unknown: Any,
    ) -> None:
        super().__init__()
        if unknown:
            raise ConfigError(
                f"{_OWNER}: unknown model argument(s) {sorted(unknown)}; the "
                f"arguments are {', '.join(_MODEL_ARGS)} (batch_size and device "
                "also come from lm-eval's --batch_size and --device)."
            )
        placement = _device(device)
        if isinstance(pretrained, DecoderLM):
            if dtype is not None and dtype != "auto":
                raise ConfigError(
                    f"{_OWNER}: dtype={dtype!r} is for a checkpoint folder; a "
                    "DecoderLM given as pretrained keeps its dtypes (convert it "
                    "first)."
                )
            if tokenizer is None:
                raise ConfigError(
                    f"{_OWNER}: pretrained is a DecoderLM, so tokenizer is "
                    "required: its folder or a blocklab Tokenizer."
                )
            model = pretrained
            if placement is not None:
                arrays, rest = eqx.partition(model, eqx.is_array)
                model = eqx.combine(jax.device_put(arrays, placement), rest)
        else:
            sharding = (
                None
                if placement is None
                else jax.sharding.SingleDeviceSharding(placement)
            )
            model = load_pretrained(pretrained, dtype=_dtype(dtype), sharding=sharding)
        if tokenizer is None:
            tokenizer = pretrained
        if not isinstance(tokenizer, Tokenizer):
            tokenizer = load_tokenizer(tokenizer)
        vocab, max_len = model_limits(model)
        if tokenizer.vocab_size > vocab:
            raise ConfigError(
                f"{_OWNER}: the tokenizer of {tokenizer.path} has "
                f"{tokenizer.vocab_size} ids, more than the model's "
                f"vocab_size={vocab}; use the model's own tokenizer."
            )
        if tokenizer.eos_id is None:
            raise ConfigError(
                f"{_OWNER}: the tokenizer of {tokenizer.path} names no EOS token; "
                "lm-eval ends texts with it (set eos_token in its "
                "tokenizer_config.json)."
            )
        self.model = model
        self.tokenizer = tokenizer
        self._batch_size = _batch_size(batch_size)
        self._max_length = check_int(
            _OWNER, "max_length", max_length, min=2, max=max_len, optional=True
        )
        if self._max_length is None:
            self._max_length = max_len
        self._max_gen_toks = check_int(_OWNER, "max_gen_toks", max_gen_toks, min=1)
        if add_bos_token is not None:
            add_bos_token = check_bool(_OWNER, "add_bos_token", add_bos_token)
        self.add_bos_token = add_bos_token
        self._prefix_token_id = check_int(
            _OWNER, "prefix_token_id", prefix_token_id,
            min=0, max=vocab - 1, optional=True,
        )  # fmt: skip
        self._key = jax.random.key(check_int(_OWNER, "seed", seed))
        self._draws = 0
        self._device = placement

    # -- what lm-eval reads ------------------------------------------------

    @property
    def batch_size(self) -> int:
        """Rows per forward pass."""
        return self._batch_size

    @property
    def max_length(self) -> int:
        """The longest input, in tokens."""
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        """New tokens of `generate_until` when `gen_kwargs` give none."""
        return self._max_gen_toks

    @property
    def eot_token_id(self) -> int:
        """EOS: the end of a text."""
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        """What an empty context is: `prefix_token_id`, else BOS, else EOS."""
        if self._prefix_token_id is not None:
            return self._prefix_token_id
        if self.tokenizer.bos_id is not None:
            return self.tokenizer.bos_id
        return self.tokenizer.eos_id

    def tok_encode(
        self, text: str, add_special_tokens: bool | None = None
    ) -> list[int]:
        """The ids of `text`, as `HFLM.tok_encode` gives them.

        `add_special_tokens=None` adds the special tokens unless
        `add_bos_token=False` or `text` already starts with the prefix
        token's text; `add_bos_token=True` puts BOS first where the folder's
        post-processor does not.
        """
        add = add_special_tokens
        if add is None:
            prefix = self.tokenizer.decode([self.prefix_token_id])
            if text.startswith(prefix):
                add = False
            else:
                add = True if self.add_bos_token is None else self.add_bos_token
        ids = self.tokenizer.encode(text, add_special_tokens=add)
        bos = self.tokenizer.bos_id
        if add and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        """Refused: chat templates are not applied (`HFLM` applies them)."""
        raise ConfigError(
            f"{_OWNER}: chat templates are not supported; run lm-eval without "
            "--apply_chat_template (or render the prompts with "
            "Tokenizer.apply_chat_template in the task)."
        )

    # -- the three requests ------------------------------------------------

    def loglikelihood(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        """`(log p(continuation | context), is_greedy)` per request.

        Args:
            requests: lm-eval `Instance`s with `args == (context,
                continuation)`.
            disable_tqdm: no progress bar.

        Returns:
            One `(float, bool)` per request, in order.
        """
        pairs = []
        for context, continuation in (req.args for req in requests):
            if context == "":
                cont = self.tok_encode(continuation, add_special_tokens=False)
                if not cont:
                    raise ConfigError(
                        f"{_OWNER}.loglikelihood: the continuation "
                        f"{continuation!r} encodes to no tokens."
                    )
                prefix = self.prefix_token_id
                ctx, cont = (
                    ([prefix], cont) if cont[0] != prefix else (cont[:1], cont[1:])
                )
            else:
                ctx, cont = self._encode_pair(context, continuation)
            pairs.append((ctx, cont))
        results = self._score_tokens(
            pairs, desc="Running loglikelihood requests", disable_tqdm=disable_tqdm
        )
        for req, answer in zip(requests, results, strict=True):
            self.cache_hook.add_partial("loglikelihood", req.args, answer)
        return results

    def loglikelihood_rolling(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[float]:
        """The log-likelihood of each text after the prefix token.

        Args:
            requests: lm-eval `Instance`s with `args == (text,)`.
            disable_tqdm: no progress bar.

        Returns:
            One float per request, the sum over its disjoint windows.
        """
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            rolling = get_rolling_token_windows(
                token_list=self.tok_encode(text),
                prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length,
                context_len=1,
            )
            for window in map(make_disjoint_window, rolling):
                windows.append(window)
                owner.append(i)
        scores = self._score_tokens(
            windows, desc="Running loglikelihood_rolling", disable_tqdm=disable_tqdm
        )
        totals = [0.0] * len(requests)
        for i, (logp, _) in zip(owner, scores, strict=True):
            totals[i] += logp
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(
        self, requests: list[Any], disable_tqdm: bool = False
    ) -> list[str]:
        """The generated continuation of each context, cut at its stop strings.

        Args:
            requests: lm-eval `Instance`s with `args == (context,
                gen_kwargs)`; `gen_kwargs` may hold `until` (a string or a
                list), `max_gen_toks` (or `max_new_tokens`, `max_tokens`,
                `max_completion_tokens`), `do_sample`, `temperature`,
                `top_k` and `top_p`.
            disable_tqdm: no progress bar.

        Returns:
            One string per request, in order.

        Raises:
            ConfigError: another `gen_kwargs` key, sampling at temperature
                0, or `max_gen_toks` leaving no room for the context.
        """
        from tqdm import tqdm

        groups: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            key = json.dumps(req.args[1], sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
        out: list[str | None] = [None] * len(requests)
        eos_text = self.tokenizer.decode([self.eot_token_id])
        bar = tqdm(
            total=len(requests), disable=disable_tqdm, desc="Running generate_until"
        )
        for members in groups.values():
            options = _gen_options(requests[members[0]].args[1], self.max_gen_toks)
            until = list(options.pop("until"))
            if eos_text not in until:
                until.append(eos_text)
            new = options.pop("max_gen_toks")
            room = self.max_length - new
            if room < 1:
                raise ConfigError(
                    f"{_OWNER}.generate_until: max_gen_toks={new} leaves no room "
                    f"for the context in max_length={self.max_length}."
                )
            prompts = {}
            for i in members:
                ids = self.tok_encode(requests[i].args[0])[-room:]
                prompts[i] = ids or [self.prefix_token_id]
            order = sorted(members, key=lambda i: -len(prompts[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                rows = [prompts[i] for i in chunk]
                width = _bucket(max(map(len, rows)), room)
                batch, lengths = self._pad(rows, width)
                key = None
                if options["sample"]:
                    key = jax.random.fold_in(self._key, self._draws)
                    self._draws += 1
                full = np.asarray(
                    generate(
                        self.model, batch, new, key=key, lengths=lengths,
                        config=GenerationConfig(
                            temperature=options["temperature"],
                            top_k=options["top_k"], top_p=options["top_p"],
                            eos_id=self.eot_token_id,
                        ),
                    )
                )  # fmt: skip
                for b, i in enumerate(chunk):
                    tokens = full[b, len(rows[b]) : len(rows[b]) + new].tolist()
                    text = self.tokenizer.decode(
                        _through_first_stop(tokens, self.tokenizer.stop_ids),
                        skip_special_tokens=True,
                    )
                    for term in until:
                        if term:
                            text = text.split(term)[0]
                    out[i] = text
                    self.cache_hook.add_partial(
                        "generate_until", requests[i].args, text
                    )
                bar.update(len(chunk))
        bar.close()
        return out

    # -- the tokenization and the forward passes ---------------------------

    def _encode_pair(
        self, context: str, continuation: str
    ) -> tuple[list[int], list[int]]:
        """The ids of a non-empty context and of its continuation.

        The whitespace ending the context moves to the continuation's front;
        the continuation's ids are those of the whole text after as many ids
        as the context alone encodes to.
        """
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        ctx = self.tok_encode(context)
        return ctx, whole[len(ctx) :]

    def _score_tokens(
        self,
        pairs: Sequence[tuple[list[int], list[int]]],
        *,
        desc: str,
        disable_tqdm: bool,
    ) -> list[tuple[float, bool]]:
        """`(sum of log p(cont | ctx), is_greedy)` per `(ctx, cont)` id pair.

        The input is `(ctx + cont)[-(max_length + 1):][:-1]`; its last
        `len(cont)` logits score `cont`. Pairs with the same input share a
        row.
        """
        from tqdm import tqdm

        rows: dict[tuple[int, ...], list[int]] = {}
        for n, (ctx, cont) in enumerate(pairs):
            if not ctx or not cont:
                what = "context" if not ctx else "continuation"
                raise ConfigError(
                    f"{_OWNER}: request {n} has a {what} of no tokens; a "
                    "request scores at least one token after at least one."
                )
            if len(cont) > self.max_length:
                raise ConfigError(
                    f"{_OWNER}: request {n} has a continuation of {len(cont)} "
                    f"tokens, more than max_length={self.max_length}."
                )
            inp = tuple((ctx + cont)[-(self.max_length + 1) :][:-1])
            rows.setdefault(inp, []).append(n)
        order = sorted(rows, key=lambda inp: (-len(inp), inp))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        bar = tqdm(total=len(pairs), disable=disable_tqdm, desc=desc)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            width = _bucket(len(chunk[0]), self.max_length)
            batch, lengths = self._pad(chunk, width)
            nxt, greedy, last = (
                np.asarray(a) for a in _score(self.model, batch, lengths)
            )
            for b, inp in enumerate(chunk):
                n = len(inp)
                for r in rows[inp]:
                    cont = pairs[r][1]
                    c = len(cont)
                    logp = float(nxt[b, n - c : n - 1].sum(dtype=np.float64))
                    logp += float(last[b, cont[-1]])
                    exact = bool((greedy[b, n - c : n] == np.asarray(cont)).all())
                    results[r] = (logp, exact)
                bar.update(len(rows[inp]))
        bar.close()
        return results

    def _pad(self, rows: Sequence[Sequence[int]], width: int) -> tuple[Any, Any]:
        """`batch_size` rows right-padded to `width` (dummy rows of one
        token fill a short batch) and their lengths, on the model's device."""
        batch = np.zeros((self.batch_size, width), np.int32)
        lengths = np.ones((self.batch_size,), np.int32)
        for b, row in enumerate(rows):
            batch[b, : len(row)] = row
            lengths[b] = len(row)
        if self._device is not None:
            return jax.device_put((batch, lengths), self._device)
        return batch, lengths


@eqx.filter_jit
def _score(
    model: DecoderLM, ids: Int[Array, "B L"], lengths: Int[Array, " B"]
) -> tuple[Float[Array, "B L-1"], Int[Array, "B L"], Float[Array, "B V"]]:
    """For right-padded rows `ids[b, :lengths[b]]`: the log-probability of
    each next input token, the argmax token at each position, and the
    log-probabilities of the token after the last input."""
    z = model(ids).astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    nxt = jnp.take_along_axis(z[:, :-1], ids[:, 1:, None], axis=-1)[..., 0]
    rows = jnp.arange(ids.shape[0])
    last = z[rows, lengths - 1] - lse[rows, lengths - 1][:, None]
    return nxt - lse[:, :-1], jnp.argmax(z, axis=-1), last


def _bucket(n: int, cap: int) -> int:
    """The padded length of a row of `n` tokens: a power of two from
    `_MIN_BUCKET`, at most `cap`."""
    width = _MIN_BUCKET
    while width < n:
        width *= 2
    return min(width, cap)


def _through_first_stop(tokens: list[int], stops: Sequence[int]) -> list[int]:
    """`tokens` up to and with the first of `stops` (what `transformers`'
    `generate` keeps before padding)."""
    for i, t in enumerate(tokens):
        if t in stops:
            return tokens[: i + 1]
    return tokens


def _gen_options(gen_kwargs: Any, default_new: int) -> dict[str, Any]:
    """`gen_kwargs` normalized as lm-eval 0.4.13's `normalize_gen_kwargs`:
    `until` a list, `max_gen_toks` from the first alias given, sampling iff
    `do_sample` (or, unset, iff `temperature > 0`)."""
    owner = f"{_OWNER}.generate_until"
    if not isinstance(gen_kwargs, dict):
        raise ConfigError(
            f"{owner}: gen_kwargs must be a dict, got {type(gen_kwargs).__name__}."
        )
    extra = sorted(set(gen_kwargs) - set(_GEN_KEYS))
    if extra:
        raise ConfigError(
            f"{owner}: gen_kwargs {extra} are not supported; the keys read are "
            f"{', '.join(_GEN_KEYS)}."
        )
    until = gen_kwargs.get("until")
    until = [] if until is None else [until] if isinstance(until, str) else until
    if not isinstance(until, list) or not all(isinstance(u, str) for u in until):
        raise ConfigError(
            f"{owner}: until must be a string or a list of strings, got {until!r}."
        )
    given = [gen_kwargs[k] for k in _MAX_TOKEN_KEYS if gen_kwargs.get(k) is not None]
    new = check_int(
        owner, "max_gen_toks", int(given[0]) if given else default_new, min=1
    )
    temperature = check_float(
        owner, "temperature", float(gen_kwargs.get("temperature", 0.0)), min=0.0
    )
    do_sample = gen_kwargs.get("do_sample")
    sample = (
        temperature > 0.0
        if do_sample is None
        else check_bool(owner, "do_sample", do_sample)
    )
    if sample and temperature == 0.0:
        raise ConfigError(
            f"{owner}: do_sample=True needs temperature > 0, got temperature=0.0 "
            "(set do_sample=False for greedy decoding)."
        )
    return {
        "until": until,
        "max_gen_toks": new,
        "sample": sample,
        "temperature": temperature if sample else 1.0,
        "top_k": gen_kwargs.get("top_k") if sample else None,
        "top_p": gen_kwargs.get("top_p") if sample else None,
    }


def _batch_size(value: Any) -> int:
    """`batch_size` as an int >= 1 (lm-eval's command line passes a str)."""
    if isinstance(value, str):
        if value.startswith("auto"):
            raise ConfigError(
                f"{_OWNER}: batch_size={value!r} is not supported; give the "
                "number of rows per forward pass (e.g. --batch_size 8)."
            )
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(
                f"{_OWNER}: batch_size must be an int >= 1, got {value!r}."
            ) from None
    return check_int(_OWNER, "batch_size", value, min=1)


def _dtype(value: Any) -> Any:
    """`dtype` for `load_pretrained`: `None` / `"auto"` keep the stored dtypes."""
    if value is None or value == "auto":
        return None
    try:
        out = jnp.dtype(value)
    except TypeError:
        out = None
    if out is None or not jnp.issubdtype(out, jnp.floating):
        raise ConfigError(
            f"{_OWNER}: dtype must be a floating dtype (float32, bfloat16, "
            f"float16) or auto, got {value!r}."
        )
    return out


def _device(value: Any) -> Any:
    """`device` (`"cpu"`, `"gpu"`/`"cuda"`, `"tpu"`, with `:index`) as a
    `jax.Device`; `None` for JAX's default device, also where JAX has no
    device of that platform (lm-eval's command line passes `"cuda:0"` unless
    told otherwise; `HFLM` falls back to the CPU likewise)."""
    if value is None:
        return None
    platform, _, index = str(value).partition(":")
    platform = {"cuda": "gpu"}.get(platform, platform)
    if platform not in ("cpu", "gpu", "tpu") or (index and not index.isdigit()):
        raise ConfigError(
            f"{_OWNER}: device must be cpu, gpu (or cuda) or tpu, optionally "
            f"with :index, got {value!r}."
        )
    try:
        devices = jax.devices(platform)
    except RuntimeError:
        _log.info("device=%r: JAX has no %s device; using its default", value, platform)
        return None
    i = int(index or 0)
    if i >= len(devices):
        raise ConfigError(
            f"{_OWNER}: device={value!r}, but JAX has {len(devices)} {platform} "
            "device(s)."
        )
    return devices[i]


if __name__ == "__main__":
    # Run as `python -m blocklab.text.lm_eval`: register the class of the
    # imported module, not of this `__main__` copy (imported by name at run
    # time: an import statement of this module in itself reads as a cycle).
    import importlib

    importlib.import_module(__spec__.name).main()
