r"""The options of a run, declared and checked once: `RunConfig`, `SweepConfig`.

`blocklab.train_model` (one run) and `blocklab.train_sweep` (K runs as one
program) read the same `RunConfig`: the batch, the precision, the chunking,
the microbatches, the rematerialization, the mesh and its rules, the
progress bar. What only a sweep has (how its members' optimizers differ,
the probe, the validation switch, the adapters, the memory analysis) is a
`SweepConfig`. Both are frozen dataclasses, so one run's options are a
value: derive another with `dataclasses.replace(run, remat="dots")`.

A bad field is refused when the config is built (`ConfigError` naming the
field, the value and the valid choices), not when the run starts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import optax
from jax.sharding import Mesh

from .._validate import ConfigError, check_bool, check_choice, check_int
from ..nn.lora import LoRAConfig
from ..nn.remat import check_remat
from .placement import PRESETS
from .step import PRECISIONS

__all__ = ["RunConfig", "SweepConfig"]


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)


@dataclass(frozen=True)
class RunConfig:
    """How a run trains: the options `train_model`, `train_lm` and `train_sweep` share.

    `RunConfig()` is the default run: float32, batches of 64 sequences for a
    token dataset, 25 steps fused per compiled call, one device, a progress
    bar. `RunConfig(batch_size=8, remat="dots")` changes two of them;
    `dataclasses.replace(run, progress=False)` derives another.

    Attributes:
        batch_size: sequences per step (and per member of a sweep) for a
            token dataset; `None` means 64 there. A general or host source
            draws its own batches, so it must stay `None` with one.
        precision: `"float32"`, or `"bf16"` for mixed precision (bfloat16
            compute, float32 master weights and optimizer state; see
            `blocklab.training.step`).
        steps_per_call: optimizer steps fused per compiled call (`>= 1`);
            the host reads the losses back once per call (and a sweep's
            `probe` runs after each call). It does not change the numbers:
            step $s$ always draws from `fold_in(key, s)`.
        microbatches: accumulate the gradients of this many microbatches
            per step in the one compiled step (`make_train_step`): the same
            update as the whole batch in less activation memory; it must
            divide the batch.
        remat: the rematerialization policy of the model's stacks for this
            run (`blocklab.nn.remat`: `"none"`, `"full"`, `"dots"`,
            `"names:..."`, `"offload:..."`, `"nested"`, a bool or a
            `jax.checkpoint_policies` callable); `None` keeps the model's
            own. With `train_model` the returned model carries it.
        mesh: a `jax.sharding.Mesh`. `train_model`: the model, its
            optimizer state and each batch are split over it
            (`blocklab.training.mesh_training`); `None`: one device.
            `train_sweep`: a mesh with a `"members"` axis (`None`: all
            devices of all processes on that axis).
        rules: how a model is split over the mesh's axes (besides
            `"members"` in a sweep): a preset of
            `blocklab.training.placement` (`"fsdp"`, `"tp"`, `"ep"`, joined
            by `+`) or a mapping logical axis -> mesh axis; `None` is
            `"fsdp"` wherever there is an axis to split over.
        progress: show a tqdm bar over the chunks.

    Raises:
        ConfigError: a field of the wrong type or out of range, named with
            its value and the valid choices.
    """

    batch_size: int | None = None
    precision: str = "float32"
    steps_per_call: int = 25
    microbatches: int = 1
    remat: Any = None
    mesh: Mesh | None = None
    rules: str | Mapping[str, Any] | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        owner = "RunConfig"
        _set(
            self,
            "batch_size",
            check_int(owner, "batch_size", self.batch_size, min=1, optional=True),
        )
        check_choice(owner, "precision", self.precision, PRECISIONS)
        _set(
            self,
            "steps_per_call",
            check_int(owner, "steps_per_call", self.steps_per_call, min=1),
        )
        _set(
            self,
            "microbatches",
            check_int(owner, "microbatches", self.microbatches, min=1),
        )
        if self.remat is not None:
            check_remat(owner, self.remat)
        if self.mesh is not None and not isinstance(self.mesh, Mesh):
            raise ConfigError(
                f"{owner}: mesh must be a jax.sharding.Mesh or None, got "
                f"{self.mesh!r} ({type(self.mesh).__name__}); build one with "
                "blocklab.training.mesh_of('data=8') or jax.make_mesh."
            )
        rules = self.rules
        if isinstance(rules, str):
            bad = [p for p in rules.split("+") if p not in PRESETS]
            if bad:
                raise ConfigError(
                    f"{owner}: rules must be a mapping or presets from "
                    f"{sorted(PRESETS)} joined by '+', got rules={rules!r}."
                )
        elif rules is not None and not isinstance(rules, Mapping):
            raise ConfigError(
                f"{owner}: rules must be None, a preset from {sorted(PRESETS)} "
                f"or a mapping logical axis -> mesh axis, got rules={rules!r}."
            )
        _set(self, "progress", check_bool(owner, "progress", self.progress))


def _check_run(owner: str, run: Any) -> RunConfig:
    """`run` if it is a `RunConfig` (the one way to pass a run's options)."""
    if not isinstance(run, RunConfig):
        raise ConfigError(
            f"{owner}: run must be a blocklab.RunConfig (e.g. RunConfig("
            f"batch_size=8, progress=False)), got {run!r} of type "
            f"{type(run).__name__}."
        )
    return run


def _run_with(owner: str, run: Any, options: Mapping[str, Any]) -> RunConfig:
    """`dataclasses.replace(run, **options)`, refusing a name that is no field."""
    run = _check_run(owner, run)
    fields = [f.name for f in dataclasses.fields(RunConfig)]
    unknown = sorted(set(options) - set(fields))
    if unknown:
        raise ConfigError(
            f"{owner}: {unknown[0]!r} is not an option of a run; the options "
            f"(RunConfig fields) are {fields}."
        )
    return dataclasses.replace(run, **options) if options else run


@dataclass(frozen=True)
class SweepConfig:
    r"""What only a sweep has: how its members' optimizers differ, and what it reports.

    `train_sweep(make_model, data, n, model_keys=..., data_keys=...,
    sweep=SweepConfig(learning_rates=[1e-3, 3e-3]))`. The members
    themselves (their model and data keys) and the run's options
    (`RunConfig`) are `train_sweep`'s own arguments; this groups the rest,
    so that the grid's optimizer side (`optimizer`, `learning_rates`,
    `hyperparams`) and the sweep's reports (`probe`, `validate`,
    `memory_analysis`) travel as one value, and `adapters` turns the sweep
    into one of adapters on a shared base.

    Attributes:
        learning_rates: one rate for all members, or K rates (> 0);
            shorthand for `hyperparams={"learning_rate": ...}`.
        hyperparams: `{name: one value or K values}` for any hyperparameter
            of `optimizer` (built with `optax.inject_hyperparams`), e.g. the
            columns of `blocklab.sweep_grid`.
        optimizer: an `optax.inject_hyperparams` transformation; `None` is
            `sweep_optimizer(optax.adamw, weight_decay=0.0)` (AdamW without
            weight decay, which needs a learning rate).
        probe: `probe(model) -> pytree of arrays`, evaluated on every member
            at step 0 and after every chunk (`SweepResult.probes`).
        validate: compute each final model's validation loss (token
            datasets with the next-token loss).
        adapters: an adapter sweep on the base model: one
            `blocklab.LoRAConfig` for every member, or a sequence of K
            `LoRAConfig`s that differ in `rank` only (member $k$ trains
            `lora(base, adapters[k], key=model_keys[k])`).
        memory_analysis: compile the first chunk ahead of time once more and
            put its `memory_analysis()` in `SweepResult.memory`.

    Raises:
        ConfigError: a field of the wrong type, named with its value (the
            values' count against K is checked by `train_sweep`).
    """

    learning_rates: Any = None
    hyperparams: Mapping[str, Any] | None = None
    optimizer: optax.GradientTransformation | None = None
    probe: Callable[[Any], Any] | None = None
    validate: bool = True
    adapters: LoRAConfig | Sequence[LoRAConfig] | None = None
    memory_analysis: bool = False

    def __post_init__(self) -> None:
        owner = "SweepConfig"
        if self.hyperparams is not None and not isinstance(self.hyperparams, Mapping):
            raise ConfigError(
                f"{owner}: hyperparams must be a mapping name -> values, got "
                f"hyperparams={self.hyperparams!r}."
            )
        if self.optimizer is not None and not isinstance(
            self.optimizer, optax.GradientTransformation
        ):
            raise ConfigError(
                f"{owner}: optimizer must be an optax transformation (built with "
                f"optax.inject_hyperparams) or None, got {self.optimizer!r}."
            )
        if self.probe is not None and not callable(self.probe):
            raise ConfigError(
                f"{owner}: probe must be callable as probe(model) or None, got "
                f"probe={self.probe!r}."
            )
        _set(self, "validate", check_bool(owner, "validate", self.validate))
        _set(
            self,
            "memory_analysis",
            check_bool(owner, "memory_analysis", self.memory_analysis),
        )
        adapters = self.adapters
        if adapters is None or isinstance(adapters, LoRAConfig):
            return
        if (
            isinstance(adapters, (str, bytes, Mapping))
            or not isinstance(adapters, Sequence)
            or not adapters
            or not all(isinstance(a, LoRAConfig) for a in adapters)
        ):
            raise ConfigError(
                f"{owner}: adapters must be a blocklab.LoRAConfig or a non-empty "
                f"sequence of them (one per member), got adapters={adapters!r}."
            )
        _set(self, "adapters", tuple(adapters))
