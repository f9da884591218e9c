r"""Induction heads: train them, find them, ablate them, patch them, read the lenses.

An *induction head* (Olsson et al. 2022, "In-context learning and induction
heads") completes a repeat: at a token $A$ it attends to the token that came
right after an earlier $A$ and copies it. It takes two layers: a
previous-token head writes $x_{j-1}$ into position $j$, and the induction
head's key at $j$ then matches the current token $x_i$ (K-composition).
This study trains a small `DecoderLM` in which they form and takes it apart
with `blocklab.interp`, every seed at once (one `train_sweep`, one vmapped
analysis program).

**Data** (`repeated_segments`). A sequence of length $T = 2S$ ends in a
repeat: a segment $r$ of $P$ tokens drawn uniformly from $V$, twice, after
$T - 2P$ uniform noise tokens, $(n_1, \ldots, n_{T-2P}, r_1, \ldots, r_P,
r_1, \ldots, r_P)$. Training draws $P$ per sequence from
$[P_{\min}, S]$: with a single length the copies always sit $P$ apart, and
a head can predict the repeat by position alone (attend $P - 1$ tokens
back), which is not induction (the `quick` protocol shows it); a spread of
distances leaves only the content-based circuit (the `cpu` protocol). The
analysis uses $P = S$, $x = (r, r)$: the first copy is unpredictable (loss
about $\log V$), the second, after its first token, is predictable from the
context only. The model is a `DecoderLM` with unit-variance embeddings
(`make_model`).

**Prefix-matching score** (`blocklab.interp.heads.prefix_matching_scores`).
For a head's pattern
$A$ (query $i$, key $j$) on sequences whose last $P$ tokens repeat the $P$
before, the mean weight from each position $i$ of the second copy to the
token right after the earlier occurrence of $x_i$, position $i - P + 1$:
$$s = \frac1P \sum_{i=T-P}^{T-1} A_{i,\, i-P+1},$$
averaged over the sequences. A head with $s$ above `threshold` on $(r, r)$
counts as an induction head. The previous-token score
$\frac1{T-1}\sum_{i\ge1} A_{i,i-1}$ finds the heads they compose with.
**Generalisation**: the score on repeats of another length $P' < S$ (after
noise); a head that matches content keeps it, one that attends a fixed
distance back loses it.

**Losses per position** (`token_losses`):
$\ell_i = -\log p(x_{i+1} \mid x_{\le i})$ for $i = 0, \ldots, T-2$. The
*in-context loss* is the mean of $\ell_i$ over $i = S, \ldots, 2S-2$ (the
second copy after its first token), the *first-copy loss* over
$i = 0, \ldots, S-2$.

**Ablation.** The induction heads' mixed values (`attn.hook_z`, each head's
output before $W_O$) are zeroed with `blocklab.interp.intervene` (`heads_edit`:
`blocklab.interp.ablate_heads` for a mask of heads that differs by layer and
by seed), and the in-context loss is compared with zeroing as many heads
drawn uniformly from the others (`random_heads`, `num_random` draws
averaged).

**Patching.** The corrupted input $x' = (r', r)$ changes every token of the
first copy ($r'_i = (r_i + u_i) \bmod V$ with $u_i$ uniform in $[1, V-1]$,
`corrupt_first_copy`), so the second copy is no longer predictable. The
induction heads' `hook_z` of the clean run (`blocklab.interp.capture`) is
patched into the corrupted run (`heads_edit` with `source`: the same as
`blocklab.interp.patch` on those heads), and the *recovery* of the
in-context loss is
$$R = \frac{\ell(x') - \ell(x' \mid z_\text{heads} \leftarrow z^\text{clean})}
{\ell(x') - \ell(x)}:$$
1 when those heads carry everything the clean run knows, 0 when nothing;
again against as many random heads.

**Lenses** (`lens_kl`). The logit lens and the Jacobian lens
(`blocklab.interp.lenses`) of each trained model on $(r, r)$: per layer the
mean of $\mathrm{KL}(p_\text{final} \,\|\, p_l)$ over the sequences and
positions, with the Jacobian lens's $J_l$ averaged over the same sequences
at the positions of the second copy. The notebook also reads a converted
`transformers` Llama.

**Seeds.** The models of all seeds train as the members of one
`blocklab.train_sweep` (one compiled, vmapped program), and the analysis of
all of them is one jitted `eqx.filter_vmap` (as are the lenses). Results
are per seed, summarised as mean $\pm$ standard deviation over the seeds.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int, PRNGKeyArray

from .._validate import ConfigError, check_bool, check_choice, check_float, check_int
from ..interp import capture, intervene
from ..interp.heads import (
    heads_edit,
    prefix_matching_scores,
    previous_token_scores,
    random_heads,
)
from ..models import DecoderConfig, DecoderLM
from ..training.run_config import RunConfig, SweepConfig
from ..training.sweep import train_sweep
from ._render import figure_links, json_floats, markdown_table
from ._seeds import check_seeds
from .protocol import check_protocol, report_estimate_hook, report_section_hook

__all__ = [
    "CPU",
    "FULL",
    "LENSES",
    "LOSSES",
    "PROTOCOLS",
    "QUICK",
    "InductionProtocol",
    "InductionResult",
    "RepeatedSegments",
    "corrupt_first_copy",
    "lens_kl",
    "make_model",
    "repeated_segments",
    "report_estimate",
    "report_section",
    "run_induction",
    "token_losses",
]

#: The sites the analysis reads and edits.
PATTERN = "blocks.*.attn.hook_pattern"
Z = "blocks.*.attn.hook_z"
#: The lenses, in the order of the figure.
LENSES = ("logit", "jacobian")
#: The per-position losses the analysis measures (`InductionResult.losses`).
LOSSES = (
    "clean", "ablated", "ablated_random", "corrupt", "patched", "patched_random"
)  # fmt: skip


# Data ----------------------------------------------------------------------


def repeated_segments(
    key: PRNGKeyArray,
    num_sequences: int,
    segment_len: int,
    vocab_size: int,
    *,
    min_repeat: int | None = None,
    max_repeat: int | None = None,
) -> Int[Array, "B T"]:
    r"""`(num_sequences, 2 * segment_len)` int32 sequences that end in a repeat.

    Row $b$ draws a length $P_b$ uniformly from `[min_repeat, max_repeat]`
    (both default to `segment_len` $= S$), a segment $r$ of $P_b$ tokens and
    $2S - 2P_b$ noise tokens, all uniform over `[0, vocab_size)`, and is
    $(n_1, \ldots, n_{2S-2P_b}, r, r)$: its last $P_b$ tokens repeat the
    $P_b$ before them. With $P_b = S$ it is $(r, r)$.
    """
    owner = "repeated_segments"
    S = check_int(owner, "segment_len", segment_len, min=2)
    V = check_int(owner, "vocab_size", vocab_size, min=2)
    B = check_int(owner, "num_sequences", num_sequences, min=1)
    hi = check_int(owner, "max_repeat", S if max_repeat is None else max_repeat,
                   min=1, max=S)  # fmt: skip
    lo = check_int(owner, "min_repeat", hi if min_repeat is None else min_repeat,
                   min=1, max=hi)  # fmt: skip
    T = 2 * S
    k_seg, k_len, k_noise = jax.random.split(key, 3)
    seg = jax.random.randint(k_seg, (B, S), 0, V, jnp.int32)
    noise = jax.random.randint(k_noise, (B, T), 0, V, jnp.int32)
    P = jax.random.randint(k_len, (B, 1), lo, hi + 1, jnp.int32)
    j = jnp.arange(T, dtype=jnp.int32)[None] - (T - 2 * P)  # index into (r, r)
    rep = jnp.take_along_axis(seg, jnp.clip(j, 0) % P, axis=-1)
    return jnp.where(j >= 0, rep, noise)


def corrupt_first_copy(
    key: PRNGKeyArray, tokens: Int[Array, "*B T"], vocab_size: int
) -> Int[Array, "*B T"]:
    r"""$(r, r) \mapsto (r', r)$, every token of the first copy changed.

    $r'_i = (r_i + u_i) \bmod V$ with $u_i$ uniform in $[1, V - 1]$, so
    $r'_i \ne r_i$ and $r'_i$ is uniform over the other $V - 1$ tokens.
    """
    V = check_int("corrupt_first_copy", "vocab_size", vocab_size, min=2)
    T = tokens.shape[-1]
    if T % 2:
        raise ConfigError(
            f"corrupt_first_copy: tokens must be (r, r), of even length; got T={T}."
        )
    S = T // 2
    shift = jax.random.randint(key, (*tokens.shape[:-1], S), 1, V, tokens.dtype)
    return jnp.concatenate([(tokens[..., :S] + shift) % V, tokens[..., S:]], -1)


class RepeatedSegments(eqx.Module):
    """The training batches: `batch(key) -> (X, Y)`, the next-token pairs of
    `repeated_segments(key, batch_size, segment_len, vocab_size, min_repeat=
    min_repeat)` (`X` the first `2S - 1` tokens, `Y` the last `2S - 1`)."""

    vocab_size: int = eqx.field(static=True)
    segment_len: int = eqx.field(static=True)
    batch_size: int = eqx.field(static=True)
    min_repeat: int | None = eqx.field(static=True, default=None)

    def batch(self, key: PRNGKeyArray) -> tuple[Int[Array, "B T"], Int[Array, "B T"]]:
        tokens = repeated_segments(
            key, self.batch_size, self.segment_len, self.vocab_size,
            min_repeat=self.min_repeat,
        )  # fmt: skip
        return tokens[:, :-1], tokens[:, 1:]


# Losses --------------------------------------------------------------------


def token_losses(
    logits: Float[Array, "*batch T V"], tokens: Int[Array, "*batch T"]
) -> Float[Array, "*batch T-1"]:
    r"""$\ell_i = -\log \mathrm{softmax}(z_i)[x_{i+1}]$ for $i = 0, \ldots,
    T-2$, in float32."""
    logp = jax.nn.log_softmax(logits[..., :-1, :].astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, tokens[..., 1:, None], axis=-1)[..., 0]


def _analyse(model, key, *, S, V, num_sequences, threshold, num_random, shorter):
    """Every measurement of one trained model (vmapped over the seeds)."""
    k_data, k_corrupt, k_random, k_short = jax.random.split(key, 4)
    clean = repeated_segments(k_data, num_sequences, S, V)
    corrupt = corrupt_first_copy(k_corrupt, clean, V)
    logits, values = capture(model, clean, [PATTERN, Z])
    pattern, z_clean = values[PATTERN], values[Z]  # (L, B, H, T, T), (L, B, T, H, p)
    scores = jnp.mean(prefix_matching_scores(pattern, S), axis=1)  # (L, H)
    heads = scores > threshold
    randoms = jax.vmap(random_heads, (0, None))(
        jax.random.split(k_random, num_random), heads
    )
    short = repeated_segments(k_short, num_sequences, S, V, max_repeat=shorter)
    _, short_values = capture(model, short, PATTERN)

    def loss(ids, edits):
        return jnp.mean(token_losses(intervene(model, ids, edits), clean), axis=0)

    def ablated(mask):
        return loss(clean, {Z: heads_edit(mask)})

    def patched(mask):
        return loss(corrupt, {Z: heads_edit(mask, source=z_clean)})

    return {
        "scores": scores,
        "prev_scores": jnp.mean(previous_token_scores(pattern), axis=1),
        "short_scores": jnp.mean(
            prefix_matching_scores(short_values[PATTERN], shorter), axis=1
        ),
        "heads": heads,
        "num_random_heads": jnp.mean(jnp.sum(randoms, axis=(-2, -1))),
        "clean": jnp.mean(token_losses(logits, clean), axis=0),
        "ablated": ablated(heads),
        "ablated_random": jnp.mean(jax.vmap(ablated)(randoms), axis=0),
        "corrupt": jnp.mean(token_losses(model(corrupt), clean), axis=0),
        "patched": patched(heads),
        "patched_random": jnp.mean(jax.vmap(patched)(randoms), axis=0),
    }


@eqx.filter_jit
def _analyse_members(models, keys, options):
    return eqx.filter_vmap(lambda m, k: _analyse(m, k, **dict(options)))(models, keys)


def lens_kl(
    model: Any, ids: Int[Array, "B T"], *, positions: Any = None
) -> dict[str, Float[Array, " L"]]:
    r"""Per layer, the mean $\mathrm{KL}(p_\text{final} \| p_l)$ over the
    sequences and positions of `ids`, of the logit lens and of the Jacobian
    lens (its $J_l$ averaged over `ids` at `positions`, default all).

    Uses `blocklab.interp.lenses` (imported here, on first use).
    """
    from ..interp import lenses

    logit = lenses.logit_lens(model, ids, k=1)
    jac = lenses.jacobians(model, ids, positions=positions)
    jacobian = lenses.jacobian_lens(model, ids, jac, k=1)

    def mean(kl):
        return jnp.mean(kl.reshape(kl.shape[0], -1), axis=-1)

    return {"logit": mean(logit.kl), "jacobian": mean(jacobian.kl)}


@eqx.filter_jit
def _lens_members(models, ids, positions):
    return eqx.filter_vmap(lambda m: lens_kl(m, ids, positions=positions))(models)


class _TrainingProbe(eqx.Module):
    """`probe(model)`: the first-copy and in-context losses and the largest
    prefix-matching score on a fixed batch of $(r, r)$, during training."""

    tokens: Int[Array, "B T"]

    def __call__(self, model: DecoderLM) -> dict[str, Float[Array, ""]]:
        return _probe(model, self.tokens)


@eqx.filter_jit
def _probe(model, tokens):
    S = tokens.shape[-1] // 2
    logits, values = capture(model, tokens, PATTERN)
    losses = jnp.mean(token_losses(logits, tokens), axis=0)
    scores = jnp.mean(prefix_matching_scores(values[PATTERN], S), axis=1)
    return {
        "first": jnp.mean(losses[: S - 1]),
        "second": jnp.mean(losses[S:]),
        "score": jnp.max(scores),
    }


# Protocol ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class InductionProtocol:
    """The sizes of the study.

    Attributes:
        name: how reports name it.
        steps: optimizer steps per seed.
        seeds: model and data seeds (the members of one sweep).
        vocab_size, segment_len: $V$ and $S$ (sequences of $T = 2S$).
        min_repeat: the shortest repeat $P_{\\min}$ of the training data.
        num_hiddens, num_heads, num_blks, positions, bias: the `DecoderLM`
            (GELU MLP, pre-norm RMSNorm, untied head).
        embed_std: the standard deviation of the token (and learned position)
            embeddings at initialization (see `make_model`).
        batch_size, learning_rate, warmup_steps: Adam with a linear warm-up
            to `learning_rate`, then constant.
        eval_sequences: sequences $(r, r)$ per analysis.
        threshold: the prefix-matching score above which a head counts as an
            induction head.
        num_random: random head sets per comparison (averaged).
        shorter: $P'$, the repeat length of the generalisation check.
        lens_sequences: sequences the lenses read (and average $J_l$ over).
        steps_per_call: training steps per compiled call (and probe period).
    """

    name: str
    steps: int
    seeds: tuple[int, ...] = (0, 1, 2)
    vocab_size: int = 32
    segment_len: int = 8
    min_repeat: int = 2
    num_hiddens: int = 64
    num_heads: int = 4
    num_blks: int = 2
    positions: str = "rope"
    bias: bool = True
    embed_std: float = 1.0
    batch_size: int = 128
    learning_rate: float = 1e-2
    warmup_steps: int = 100
    eval_sequences: int = 64
    threshold: float = 0.4
    num_random: int = 8
    shorter: int = 5
    lens_sequences: int = 8
    steps_per_call: int = 100

    def __post_init__(self) -> None:
        owner = "InductionProtocol"
        object.__setattr__(self, "seeds", check_seeds(self.seeds, _owner=owner))
        ints = dict(steps=1, vocab_size=2, segment_len=2, min_repeat=1, num_hiddens=1,
                    num_heads=1, num_blks=2, batch_size=1, warmup_steps=0,
                    eval_sequences=1, num_random=1, shorter=1, lens_sequences=1,
                    steps_per_call=1)  # fmt: skip
        for name, lo in ints.items():
            object.__setattr__(
                self, name, check_int(owner, name, getattr(self, name), min=lo)
            )
        if self.min_repeat > self.segment_len or self.shorter >= self.segment_len:
            raise ConfigError(
                f"{owner}: need min_repeat <= segment_len and shorter < segment_len, "
                f"got min_repeat={self.min_repeat}, shorter={self.shorter}, "
                f"segment_len={self.segment_len}."
            )
        if self.num_hiddens % self.num_heads:
            raise ConfigError(
                f"{owner}: num_hiddens={self.num_hiddens} must be a multiple of "
                f"num_heads={self.num_heads}."
            )
        check_choice(owner, "positions", self.positions, ("rope", "learned"))
        object.__setattr__(self, "bias", check_bool(owner, "bias", self.bias))
        check_float(owner, "learning_rate", self.learning_rate, min=0.0, min_open=True)
        check_float(owner, "embed_std", self.embed_std, min=0.0, min_open=True)
        check_float(owner, "threshold", self.threshold, min=0.0, max=1.0)

    def replace(self, **changes: Any) -> InductionProtocol:
        return dataclasses.replace(self, **changes)

    @property
    def config(self) -> DecoderConfig:
        """The model's `DecoderConfig`."""
        return DecoderConfig(
            self.vocab_size, self.num_hiddens, self.num_heads, self.num_blks,
            act="gelu", norm="rms", bias=self.bias, positions=self.positions,
            max_len=2 * self.segment_len, tie_embeddings=False,
        )  # fmt: skip


#: The report's (`blocklab report`, also `--quick`) and `--protocol quick`:
#: one repeat length ($P = S$), where the heads that form find the earlier
#: copy by its distance (their score on repeats of `shorter` is 0); about
#: 20 s on 2 CPU cores.
QUICK = InductionProtocol(
    "quick", 100, seeds=(0, 1), min_repeat=8, batch_size=32, warmup_steps=20,
    eval_sequences=32, num_random=4, lens_sequences=4, steps_per_call=50,
)  # fmt: skip
#: `blocklab induction` (the default): repeats of 2 to 8 tokens, three seeds;
#: a previous-token head in layer 0 and induction heads in layer 1 form
#: between steps 1000 and 1500; a few minutes on 2 CPU cores.
CPU = InductionProtocol("cpu", 2000, seeds=(0, 1, 2), batch_size=64,
                        steps_per_call=250)  # fmt: skip
#: On an accelerator: the `cpu` recipe with eight seeds, a larger batch and
#: more steps and evaluation sequences.
FULL = CPU.replace(name="full", steps=3000, seeds=tuple(range(8)), batch_size=128,
                   eval_sequences=256, steps_per_call=500)  # fmt: skip
PROTOCOLS = {p.name: p for p in (QUICK, CPU, FULL)}


@functools.cache
def _optimizer(warmup_steps: int) -> optax.GradientTransformationExtraArgs:
    # One object per warm-up, so repeated runs reuse the compiled step.
    warmup = float(max(warmup_steps, 1))

    def adam(learning_rate):
        return optax.adam(lambda t: learning_rate * jnp.minimum(1.0, (t + 1) / warmup))

    return optax.inject_hyperparams(adam, hyperparam_dtype=jnp.float32)(
        learning_rate=1.0
    )


def make_model(protocol: InductionProtocol, key: PRNGKeyArray) -> DecoderLM:
    r"""The study's `DecoderLM` (`protocol.config`) with its token embedding
    (and learned position table) drawn from $N(0, \sigma^2)$, $\sigma$ =
    `protocol.embed_std`.

    The library's default $\sigma = 0.02$ is far below what Adam at a rate
    of $10^{-2}$ moves in a few steps: the embeddings are then rewritten by
    the first updates, the heads of layer 0 collapse onto one pattern, and
    on this task the induction circuit had not formed after 4000 steps of
    batch 64 (`CPU` otherwise, 3 seeds). At $\sigma = 1$ it forms between
    steps 1000 and 1500 in each of them.
    """
    k_model, k_tok, k_pos = jax.random.split(key, 3)
    model = DecoderLM(protocol.config, key=k_model)

    def draw(k, w):
        return protocol.embed_std * jax.random.normal(k, w.shape, w.dtype)

    model = eqx.tree_at(
        lambda m: m.token_emb.weight, model, draw(k_tok, model.token_emb.weight)
    )
    if model.pos_emb is not None:
        model = eqx.tree_at(
            lambda m: m.pos_emb.weight, model, draw(k_pos, model.pos_emb.weight)
        )
    return model


# Result --------------------------------------------------------------------


def _mean_sd(x: Any) -> tuple[float, float]:
    """Mean and sample standard deviation of the finite values (NaN if none;
    sd 0 for one)."""
    x = np.asarray(x, np.float64).ravel()
    x = x[np.isfinite(x)]
    if x.size == 0:
        return math.nan, math.nan
    return float(np.mean(x)), float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def _num(v: float, digits: int) -> str:
    return f"{v:.{digits}f}" if math.isfinite(v) else "–"


def _fmt(x: Any, digits: int = 3) -> str:
    m, s = _mean_sd(x)
    return f"{_num(m, digits)} ± {_num(s, digits)}"


def _per_seed(x: Any, digits: int = 3) -> str:
    return ", ".join(_num(v, digits) for v in np.asarray(x, np.float64).ravel())


@dataclasses.dataclass(frozen=True)
class InductionResult:
    """What `run_induction` returns (per seed `k`; `L` layers, `H` heads).

    Attributes:
        protocol: the protocol run.
        probe_steps: `(R,)` the steps at which training was probed.
        probes: `first`, `second` (first-copy and in-context loss) and
            `score` (largest prefix-matching score), each `(K, R)`.
        train_losses: `(K, steps)` training losses.
        scores: `(K, L, H)` prefix-matching scores on $(r, r)$.
        prev_scores: `(K, L, H)` previous-token scores.
        short_scores: `(K, L, H)` prefix-matching scores on repeats of
            length `protocol.shorter`.
        heads: `(K, L, H)` the induction heads (score above the threshold).
        num_random_heads: `(K,)` heads per random set (as many as `heads`
            unless fewer others exist).
        losses: each of `LOSSES` -> `(K, 2S - 1)` mean loss per position.
        lens: each of `LENSES` -> `(K, L)` mean KL to the final distribution,
            or `None` when the lenses could not run (see `lens_note`).
        lens_note: why `lens` is `None`, else `""`.
        seconds: wall-clock seconds of `train`, `analysis` and `lens`.
        models: the trained `DecoderLM`s stacked over the seeds (leading axis
            `K`; `model(k)` unstacks one), or `None`; not part of the JSON.
    """

    protocol: InductionProtocol
    probe_steps: np.ndarray
    probes: dict[str, np.ndarray]
    train_losses: np.ndarray
    scores: np.ndarray
    prev_scores: np.ndarray
    short_scores: np.ndarray
    heads: np.ndarray
    num_random_heads: np.ndarray
    losses: dict[str, np.ndarray]
    lens: dict[str, np.ndarray] | None
    lens_note: str
    seconds: dict[str, float]
    models: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def seeds(self) -> tuple[int, ...]:
        return self.protocol.seeds

    def model(self, k: int) -> DecoderLM:
        """Seed `k`'s trained model (the `k`-th of `seeds`)."""
        if self.models is None:
            raise ConfigError("InductionResult.model: this result holds no models.")
        k = check_int("InductionResult.model", "k", k, min=0, max=len(self.seeds) - 1)
        return jax.tree_util.tree_map(
            lambda a: a[k] if eqx.is_array(a) else a, self.models
        )

    def first_copy_loss(self) -> np.ndarray:
        """`(K,)` mean loss over predictions $0 .. S-2$ of the clean run."""
        S = self.protocol.segment_len
        return np.mean(self.losses["clean"][:, : S - 1], axis=-1)

    def in_context_loss(self, name: str = "clean") -> np.ndarray:
        """`(K,)` mean loss over predictions $S .. 2S-2$ of run `name`."""
        check_choice("InductionResult.in_context_loss", "name", name, LOSSES)
        return np.mean(self.losses[name][:, self.protocol.segment_len :], axis=-1)

    def recovery(self, random: bool = False) -> np.ndarray:
        """`(K,)` the patching recovery $R$ of the induction heads (or, with
        `random`, of as many random heads); NaN where there is no gap."""
        patched = self.in_context_loss("patched_random" if random else "patched")
        corrupt, clean = self.in_context_loss("corrupt"), self.in_context_loss()
        gap = corrupt - clean
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(np.abs(gap) > 1e-6, (corrupt - patched) / gap, np.nan)

    def num_heads_found(self) -> np.ndarray:
        """`(K,)` how many heads score above the threshold."""
        return self.heads.reshape(self.heads.shape[0], -1).sum(-1)

    def head_names(self, k: int) -> list[str]:
        """Seed `k`'s induction heads as `"layer.head"`."""
        layers, heads = np.nonzero(self.heads[k])
        return [f"{a}.{b}" for a, b in zip(layers, heads, strict=True)]

    def content_based(self) -> np.ndarray:
        """`(K,)` whether some induction head also matches prefixes on repeats
        of the other length `protocol.shorter` (score above the threshold
        there too): it finds the earlier token by content, not by distance."""
        keep = self.heads & (self.short_scores > self.protocol.threshold)
        return keep.reshape(keep.shape[0], -1).any(-1)

    def formed(self) -> np.ndarray:
        """`(K,)` whether induction heads formed: the in-context loss is below
        half the first-copy loss and some head matches prefixes by content
        (`content_based`)."""
        return self.content_based() & (
            self.in_context_loss() < 0.5 * self.first_copy_loss()
        )

    def _heads_mean(self, values: np.ndarray) -> np.ndarray:
        """`(K,)` the mean of `values` `(K, L, H)` over each seed's induction
        heads (NaN without any)."""
        n = self.num_heads_found()
        total = np.sum(np.where(self.heads, values, 0.0), axis=(-2, -1))
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(n > 0, total / np.maximum(n, 1), np.nan)

    def rows(self) -> list[tuple[str, np.ndarray, int]]:
        """`(label, (K,) values, digits)` of the summary table."""
        p = self.protocol
        return [
            (f"first-copy loss (log V = {math.log(p.vocab_size):.3f})",
             self.first_copy_loss(), 3),
            ("in-context loss, clean", self.in_context_loss(), 3),
            ("in-context loss, induction heads ablated",
             self.in_context_loss("ablated"), 3),
            ("in-context loss, as many random heads ablated",
             self.in_context_loss("ablated_random"), 3),
            ("in-context loss, first copy corrupted",
             self.in_context_loss("corrupt"), 3),
            ("patching recovery, induction heads", self.recovery(), 3),
            ("patching recovery, random heads", self.recovery(random=True), 3),
            ("induction heads found", self.num_heads_found(), 1),
            ("their prefix-matching score", self._heads_mean(self.scores), 3),
            (f"their score on repeats of {p.shorter} after noise",
             self._heads_mean(self.short_scores), 3),
            ("largest previous-token score", self.prev_scores.max(axis=(-2, -1)), 3),
        ]  # fmt: skip

    def table(self) -> str:
        """Markdown: each quantity as mean ± sd over the seeds, and per seed."""
        header = ["quantity", "mean ± sd", f"per seed {list(self.seeds)}"]
        body = [[label, _fmt(v, d), _per_seed(v, d)] for label, v, d in self.rows()]
        if self.lens is not None:
            for lens in LENSES:
                kl = self.lens[lens]
                body.append([f"{lens} lens: KL to the final distribution, layer 0",
                             _fmt(kl[:, 0]), _per_seed(kl[:, 0])])  # fmt: skip
        heads = "; ".join(
            f"seed {s}: {', '.join(self.head_names(k)) or 'none'}"
            for k, s in enumerate(self.seeds)
        )
        return markdown_table(header, body, align="lrr") + (
            f"\n\nInduction heads (layer.head, score > {self.protocol.threshold:g}): "
            f"{heads}."
        )

    def to_json(self) -> dict[str, Any]:
        summary = {}
        for label, v, _ in self.rows():
            m, s = _mean_sd(v)
            summary[label] = {
                "mean": json_floats(m),
                "sd": json_floats(s),
                "per_seed": json_floats(v),
            }
        return {
            "protocol": dataclasses.asdict(self.protocol),
            "seeds": list(self.seeds),
            "formed": [bool(f) for f in self.formed()],
            "summary": summary,
            "first_copy_loss": json_floats(self.first_copy_loss()),
            "in_context_loss": {
                n: json_floats(self.in_context_loss(n)) for n in LOSSES
            },
            "recovery": json_floats(self.recovery()),
            "recovery_random": json_floats(self.recovery(random=True)),
            "heads": [self.head_names(k) for k in range(len(self.seeds))],
            "scores": json_floats(self.scores),
            "prev_scores": json_floats(self.prev_scores),
            "short_scores": json_floats(self.short_scores),
            "losses_per_position": {n: json_floats(v) for n, v in self.losses.items()},
            "probe_steps": [int(s) for s in self.probe_steps],
            "probes": {n: json_floats(v) for n, v in self.probes.items()},
            "lens_kl": None
            if self.lens is None
            else {n: json_floats(v) for n, v in self.lens.items()},
            "lens_note": self.lens_note,
            "seconds": dict(self.seconds),
        }

    def figures(self, out_dir: str | Path) -> list[Path]:
        """`induction_training.png`, `induction_scores.png`,
        `induction_loss_per_position.png`, `induction_patching.png` and (with
        the lenses) `induction_lenses.png`."""
        out = Path(out_dir)
        paths = [
            self._plot_training(out / "induction_training.png"),
            self._plot_scores(out / "induction_scores.png"),
            self._plot_positions(out / "induction_loss_per_position.png"),
            self._plot_patching(out / "induction_patching.png"),
        ]
        if self.lens is not None:
            paths.append(self._plot_lenses(out / "induction_lenses.png"))
        return paths

    def _plot_training(self, path: Path) -> Path:
        from .plotting import _save, plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
        x = self.probe_steps
        for name, label in (
            ("first", "first copy"),
            ("second", "second copy (in context)"),
        ):
            y = self.probes[name]
            (line,) = ax.plot(x, np.nanmean(y, 0), label=label)
            ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), alpha=0.2,
                            color=line.get_color())  # fmt: skip
        ax.axhline(math.log(self.protocol.vocab_size), ls="--", c="gray", lw=1)
        ax.set(xlabel="step", ylabel="loss on (r, r)", title="losses during training")
        ax.legend(fontsize=8)
        y = self.probes["score"]
        bx.plot(x, np.nanmean(y, 0))
        bx.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), alpha=0.2)
        bx.axhline(self.protocol.threshold, ls="--", c="gray", lw=1)
        bx.set(xlabel="step", ylabel="score", ylim=(0, 1),
               title="largest prefix-matching score")  # fmt: skip
        for a in (ax, bx):
            a.grid(alpha=0.3)
        fig.suptitle(f"seeds {list(self.seeds)}: mean, band min-max", fontsize=9)
        return _save(fig, path)

    def _plot_scores(self, path: Path) -> Path:
        from .plotting import _save, plt

        panels = [
            (self.scores, "prefix-matching score on (r, r)"),
            (self.short_scores, f"prefix-matching, repeats of {self.protocol.shorter}"),
            (self.prev_scores, "previous-token score"),
        ]
        L, H = self.scores.shape[1:]
        fig, axes = plt.subplots(1, 3, figsize=(12, 1.2 + 0.9 * L), dpi=110)
        for ax, (values, title) in zip(axes, panels, strict=True):
            m = np.nanmean(values, 0)
            im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", aspect="auto")
            for (layer, head), v in np.ndenumerate(m):
                ax.text(head, layer, f"{v:.2f}", ha="center", va="center", fontsize=8,
                        color="white" if v < 0.6 else "black")  # fmt: skip
            ax.set(xticks=range(H), yticks=range(L), xlabel="head", ylabel="layer",
                   title=title)  # fmt: skip
            ax.title.set_fontsize(9)
        fig.colorbar(im, ax=axes[-1])
        fig.suptitle(f"mean over seeds {list(self.seeds)}", fontsize=9)
        return _save(fig, path)

    def _plot_positions(self, path: Path) -> Path:
        from .plotting import _save, plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
        labels = {"clean": "clean", "ablated": "induction heads ablated",
                  "ablated_random": "random heads ablated",
                  "corrupt": "first copy corrupted"}  # fmt: skip
        x = np.arange(1, self.losses["clean"].shape[1] + 1)  # the token predicted
        for name, label in labels.items():
            y = self.losses[name]
            (line,) = ax.plot(x, np.nanmean(y, 0), marker=".", label=label)
            ax.fill_between(x, np.nanmin(y, 0), np.nanmax(y, 0), alpha=0.15,
                            color=line.get_color())  # fmt: skip
        S = self.protocol.segment_len
        ax.axvline(S - 0.5, ls=":", c="k", lw=1)
        ax.axhline(math.log(self.protocol.vocab_size), ls="--", c="gray", lw=1)
        ax.annotate("log V", (0.01, math.log(self.protocol.vocab_size)),
                    xycoords=("axes fraction", "data"), fontsize=8)  # fmt: skip
        ax.set(xlabel=f"position of the predicted token (second copy from {S})",
               ylabel="loss", title="loss per position on (r, r)")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        return _save(fig, path)

    def _plot_patching(self, path: Path) -> Path:
        from .plotting import _save, plt

        fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 3.8), dpi=110)
        groups = [
            (ax, [("clean", self.in_context_loss()),
                  ("induction\nablated", self.in_context_loss("ablated")),
                  ("random\nablated", self.in_context_loss("ablated_random"))],
             "in-context loss", "ablation"),
            (bx, [("induction\nheads", self.recovery()),
                  ("random\nheads", self.recovery(random=True))],
             "recovery R", "patching clean -> corrupted"),
        ]  # fmt: skip
        for a, bars, ylabel, title in groups:
            for i, (_, v) in enumerate(bars):
                m = np.nanmean(v) if np.isfinite(v).any() else 0.0
                a.bar(i, m, color=f"C{i}", alpha=0.7)
                a.plot(np.full(v.shape, i), v, "k.", ms=6)
            a.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
            a.set(ylabel=ylabel, title=title)
            a.grid(alpha=0.3, axis="y")
        bx.axhline(1.0, ls="--", c="gray", lw=1)
        fig.suptitle(f"bars: mean; dots: seeds {list(self.seeds)}", fontsize=9)
        return _save(fig, path)

    def _plot_lenses(self, path: Path) -> Path:
        from .plotting import _save, plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
        layers = np.arange(self.lens["logit"].shape[1])
        for name in LENSES:
            kl = self.lens[name]
            (line,) = ax.plot(layers, np.mean(kl, 0), marker="o", label=f"{name} lens")
            ax.fill_between(layers, np.min(kl, 0), np.max(kl, 0), alpha=0.2,
                            color=line.get_color())  # fmt: skip
        ax.set(xticks=layers, xlabel="layer l (the stream after block l)",
               ylabel="KL(p_final || p_l), nats",
               title="lenses of the trained models on (r, r)")  # fmt: skip
        ax.grid(alpha=0.3)
        ax.legend()
        fig.suptitle(f"seeds {list(self.seeds)}: mean, band min-max", fontsize=9)
        return _save(fig, path)


# The study -----------------------------------------------------------------


def run_induction(
    protocol: InductionProtocol = CPU,
    *,
    lenses: bool = True,
    progress: bool = False,
) -> InductionResult:
    """Train, find, ablate, patch and read the lenses, for every seed at once.

    Args:
        protocol: an `InductionProtocol` (`QUICK`, `CPU`, `FULL` or your own).
        lenses: also compute the logit and Jacobian lenses (`lens_kl`).
        progress: a tqdm bar over the training chunks.

    Returns:
        An `InductionResult`.
    """
    owner = "run_induction"
    check_protocol(
        owner, protocol, InductionProtocol, str(sorted(PROTOCOLS)), article="an"
    )
    lenses = check_bool(owner, "lenses", lenses)
    progress = check_bool(owner, "progress", progress)
    p = protocol
    S, V = p.segment_len, p.vocab_size
    seeds = np.asarray(p.seeds, np.int64)
    probe_ids = repeated_segments(jax.random.key(2**31 - 1), 32, S, V)
    seconds = {}

    t0 = time.perf_counter()
    sweep = train_sweep(
        functools.partial(make_model, p),
        RepeatedSegments(V, S, p.batch_size, p.min_repeat),
        p.steps,
        model_keys=seeds,
        data_keys=seeds + 1000,
        run=RunConfig(steps_per_call=min(p.steps_per_call, p.steps), progress=progress),
        sweep=SweepConfig(
            learning_rates=p.learning_rate,
            optimizer=_optimizer(p.warmup_steps),
            probe=_TrainingProbe(probe_ids),
            validate=False,
        ),
    )
    seconds["train"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    keys = jax.vmap(lambda s: jax.random.fold_in(jax.random.key(s), 1))(seeds)
    options = (
        ("S", S), ("V", V), ("num_sequences", p.eval_sequences),
        ("threshold", p.threshold), ("num_random", p.num_random),
        ("shorter", p.shorter),
    )  # fmt: skip
    out = jax.tree_util.tree_map(
        np.asarray, _analyse_members(sweep.state.model, keys, options)
    )
    seconds["analysis"] = time.perf_counter() - t0

    lens, note = None, ""
    if lenses:
        t0 = time.perf_counter()
        try:
            ids = repeated_segments(jax.random.key(2**31 - 2), p.lens_sequences, S, V)
            kl = _lens_members(sweep.state.model, ids, tuple(range(S, 2 * S)))
            lens = {n: np.asarray(kl[n]) for n in LENSES}
        except ImportError as err:
            note = f"the lenses need blocklab.interp.lenses, which is missing ({err})."
        seconds["lens"] = time.perf_counter() - t0
    else:
        note = "not computed (lenses=False)."

    return InductionResult(
        protocol=p,
        probe_steps=np.asarray(sweep.probe_steps),
        probes={n: np.asarray(v, np.float64) for n, v in sweep.probes.items()},
        train_losses=np.asarray(sweep.losses),
        scores=out["scores"],
        prev_scores=out["prev_scores"],
        short_scores=out["short_scores"],
        heads=out["heads"].astype(bool),
        num_random_heads=out["num_random_heads"],
        losses={n: out[n].astype(np.float64) for n in LOSSES},
        lens=lens,
        lens_note=note,
        seconds=seconds,
        models=sweep.state.model,
    )


# Report --------------------------------------------------------------------


def report_protocol(*, quick: bool = False, full: bool = False) -> InductionProtocol:
    """The report's protocol: `FULL` with `full`, else `QUICK` (the CPU report
    gives this section seconds; `blocklab induction` runs `CPU`)."""
    return FULL if full else QUICK


def estimate_seconds(protocol: InductionProtocol, *, lenses: bool = True) -> float:
    """Seconds on 2 idle CPU cores: compilation (about 18 s, 10 s more with
    the lenses), then the training steps, linear in steps x seeds x batch x
    tokens x width."""
    p = protocol
    work = p.steps * len(p.seeds) * p.batch_size * 2 * p.segment_len * p.num_hiddens
    return 18.0 + (10.0 if lenses else 0.0) + 2e-7 * work


@report_estimate_hook("induction")
def report_estimate(*, quick: bool, full: bool) -> float:
    """Seconds on 2 idle CPU cores for the report's protocol (the lenses only
    with `full`)."""
    return estimate_seconds(report_protocol(quick=quick, full=full), lenses=full)


@report_section_hook("induction")
def report_section(out_dir: Path, *, quick: bool, full: bool, progress: bool) -> str:
    """The induction-heads section: train, find, ablate, patch (and, with
    `full`, the lenses)."""
    p = report_protocol(quick=quick, full=full)
    res = run_induction(p, lenses=full, progress=progress)
    paths = res.figures(out_dir)
    K = len(p.seeds)
    found = int((res.num_heads_found() > 0).sum())
    content = int(res.content_based().sum())
    note = "" if full else (
        f"Protocol `{p.name}`, sized for the report on a CPU: one repeat length, "
        "so a head can find the earlier copy by its distance alone; the "
        "generalisation row (the same heads on repeats of another length) says "
        "whether they match by content. `blocklab induction` runs the `cpu` "
        "protocol (repeats of 2 to 8 tokens, three seeds, a few minutes on 2 "
        "cores) with the logit and Jacobian lenses.\n\n"
    )  # fmt: skip
    m = p.config
    lengths = (
        f"{p.segment_len}"
        if p.min_repeat == p.segment_len
        else f"{p.min_repeat} to {p.segment_len}"
    )
    lens = f"Lenses: {res.lens_note}\n\n" if full and res.lens is None else ""
    return (
        "## Induction heads: find, ablate, patch, lenses\n\n"
        f"{note}A {m.num_blks}-layer DecoderLM (d = {m.num_hiddens}, "
        f"{m.num_heads} heads, {p.positions} positions) trained {p.steps} steps on "
        f"repeats of {lengths} random tokens (V = {p.vocab_size}) after noise, "
        f"seeds {list(p.seeds)} as one vmapped sweep. Heads with a prefix-matching "
        f"score above {p.threshold:g} on (r, r), S = {p.segment_len} (the table's "
        f"induction heads): found in {found} of {K} seeds, matching by content in "
        f"{content} of {K}. Mean ± sd over the seeds.\n\n"
        f"{lens}{res.table()}\n\n" + figure_links(paths) + "\n"
    )
