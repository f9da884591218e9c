r"""The one training loop: compiled chunks, progress, aux, divergence, validation.

`train_model` (one run) and `train_sweep` (K members, vmapped and sharded)
differ only in how a chunk of steps is compiled and run; everything around
it is `run_chunks`:

- the run is cut into chunks of `steps_per_call` fused steps, the last one
  shorter; chunk $c$ covers steps $[s_c, s_c + n_c)$ and is one call of
  `advance(state, s_c, n_c)`;
- the host reads each chunk's losses back (shape `(*members, n_c)`; `()`
  members for one run) and its aux (leaves `(*members, n_c, ...)`), and shows
  them on a tqdm bar;
- a member has *diverged at* step $d$ (1-based) when its loss at step $d$ is
  the first non-finite one (`TrainStep` reports a skipped update as NaN and
  freezes the member), 0 when it never diverged; with
  `stop_on_divergence=True` the loop stops after the chunk in which every
  member has diverged;
- `advance` may return fewer than $n_c$ losses when its batch source ran out
  (a host iterator); the loop stops after them (`steps_run` says how many);
- `after_chunk(state, steps_done)` runs after each chunk (a sweep's probes);
- `validate(model)`, if given, is the final model's validation loss.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from tqdm.auto import tqdm

from .._validate import check_bool, check_int

__all__ = ["LoopOutput", "run_chunks"]


@dataclass(frozen=True)
class LoopOutput:
    """What `run_chunks` returns.

    Attributes:
        state: the state after the last chunk run.
        losses: `(*members, num_steps)` float32 losses; NaN from a member's
            divergence on, and for the steps not run after a stop.
        diverged_at: `(*members,)` int64: the 1-based step of the first
            non-finite loss, 0 where none.
        aux: the aux pytree, each leaf `(*members, steps_run, ...)`, or `None`.
        steps_run: steps the loop ran (`num_steps` unless it stopped).
        val_loss: `validate(state.model)` as NumPy (NaN without `validate`).
    """

    state: Any
    losses: np.ndarray
    diverged_at: np.ndarray
    aux: Any
    steps_run: int
    val_loss: np.ndarray


def _first_nonfinite(losses: np.ndarray, offset: int) -> np.ndarray:
    """1-based step (counting from `offset`) of the first non-finite loss, else 0."""
    bad = ~np.isfinite(losses)
    if bad.shape[-1] == 0:
        return np.zeros(bad.shape[:-1], np.int64)
    return np.where(bad.any(-1), np.argmax(bad, -1) + 1 + offset, 0)


def run_chunks(
    advance: Callable[[Any, int, int], tuple[Any, np.ndarray, Any]],
    state: Any,
    num_steps: int,
    steps_per_call: int,
    *,
    has_aux: bool,
    members: tuple[int, ...] = (),
    stop_on_divergence: bool = False,
    after_chunk: Callable[[Any, int], None] | None = None,
    validate: Callable[[Any], Any] | None = None,
    desc: str = "train",
    progress: bool = True,
) -> LoopOutput:
    """Run `num_steps` steps as chunks of `steps_per_call` (see the module docstring).

    Args:
        advance: `advance(state, start, n) -> (state, losses, aux)`: steps
            `start .. start + n - 1` (0-based, counted from this run's first
            step); `losses` a host array `(*members, n)`, `aux` a pytree of
            host arrays `(*members, n, ...)` or `None`.
        state: the state before the first step (`state.model` is validated).
        num_steps, steps_per_call: steps in all, and per call (>= 1).
        has_aux: whether `advance` returns an aux.
        members: the leading shape of the losses: `()` for one run, `(K,)`.
        stop_on_divergence: stop once every member has diverged.
        after_chunk: called as `after_chunk(state, steps_done)` after each chunk.
        validate: `validate(model)` of the final model, or `None`.
        desc, progress: the tqdm bar's label, and whether to show it.
    """
    owner = "run_chunks"
    num_steps = check_int(owner, "num_steps", num_steps, min=1)
    steps_per_call = check_int(owner, "steps_per_call", steps_per_call, min=1)
    stop_on_divergence = check_bool(owner, "stop_on_divergence", stop_on_divergence)
    losses = np.full((*members, num_steps), np.nan, np.float32)
    diverged = np.zeros(members, np.int64)
    auxes: list[Any] = []
    done = 0
    with tqdm(total=num_steps, desc=desc, unit="step", disable=not progress) as bar:
        while done < num_steps:
            n = min(steps_per_call, num_steps - done)
            state, chunk, aux = advance(state, done, n)
            chunk = np.asarray(chunk, np.float32)
            # Fewer than n losses: the source ran out after them; stop there.
            ran_out = chunk.shape[-1] < n
            n = chunk.shape[-1]
            losses[..., done : done + n] = chunk
            if has_aux and n:
                auxes.append(aux)
            first = _first_nonfinite(chunk, done)
            diverged = np.where((diverged == 0) & (first > 0), first, diverged)
            done += n
            if after_chunk is not None:
                after_chunk(state, done)
            if stop_on_divergence and np.all(diverged > 0):
                # Show the steps that were applied: those before the first NaN.
                bar.update(n - done + int(np.min(diverged)) - 1)
                break
            bar.update(n)
            if ran_out:
                break
            last = chunk[..., -1]
            if members == ():
                bar.set_postfix(loss=f"{float(last):.3f}")
            else:
                alive = np.isfinite(last)
                best = np.min(last[alive]) if alive.any() else math.nan
                bar.set_postfix(alive=f"{alive.sum()}/{alive.size}", best=f"{best:.3f}")
    axis = len(members)
    aux_out = (
        jax.tree_util.tree_map(lambda *a: np.concatenate(a, axis), *auxes)
        if auxes
        else None
    )
    if validate is None:
        val = np.full(members, np.nan, np.float32)
    else:
        val = np.asarray(validate(state.model))
    return LoopOutput(state, losses, diverged, aux_out, done, val)
