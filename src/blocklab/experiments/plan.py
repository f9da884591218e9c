r"""A memory plan: what one device holds for a model on a mesh, without allocating it.

For a `DecoderConfig`, a mesh shape (`data=8,model=4`) and sharding rules,
`plan(...)` reports per device:

- **parameters**: $\sum_x \mathrm{bytes}(x) / s_x$ over the model's arrays,
  where $s_x$ is the number of pieces $x$ is split into under the rules
  (`blocklab.training.placement`); from `jax.eval_shape` of the model, on a
  `jax.sharding.AbstractMesh` (no devices needed, any size);
- **optimizer state**: the same sum over AdamW's state (two moments shaped
  like the parameters, sharded like them, and its scalars);
- **temporaries** (activations saved for the backward pass, gradients,
  gathered weights, collective buffers): `temp_size_in_bytes` of the
  compiled training step's `memory_analysis()` at a batch and length. This
  needs the program compiled for the mesh, so `compile=True` runs in a child
  process with that many simulated CPU devices
  (`XLA_FLAGS=--xla_force_host_platform_device_count=N`); the inputs are
  `jax.ShapeDtypeStruct`s, so nothing is allocated. (A CPU compile of a
  large mesh takes minutes; the GPU/TPU compiler's figure differs somewhat.)

Presets: `PRESET_CONFIGS` (`llama3-8b`, `llama3-70b` with the published
sizes, and the library's small family presets); or a JSON file of
`DecoderConfig` fields (or `DecoderLM.init_args()`'s output).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._validate import ConfigError, check_choice, check_int
from ..nn import DecoderConfig, DecoderLM
from ..training.mesh_training import state_shardings
from ..training.placement import parse_mesh, resolve_rules
from ..training.step import PRECISIONS, init_state

__all__ = ["PRESET_CONFIGS", "PlanResult", "config_of", "plan", "plans_table"]

#: Published sizes (Llama 3 model card / config.json) and the small presets.
PRESET_CONFIGS: dict[str, Any] = {
    "llama3-8b": lambda: DecoderConfig.llama(
        vocab_size=128256, num_hiddens=4096, num_heads=32, num_blks=32,
        num_kv_heads=8, ffn_width=14336, rope_theta=500000.0, norm_eps=1e-5,
        max_len=8192,
    ),
    "llama3-70b": lambda: DecoderConfig.llama(
        vocab_size=128256, num_hiddens=8192, num_heads=64, num_blks=80,
        num_kv_heads=8, ffn_width=28672, rope_theta=500000.0, norm_eps=1e-5,
        max_len=8192,
    ),
    "gpt2": DecoderConfig.gpt2,
    "llama": DecoderConfig.llama,
    "olmo2": DecoderConfig.olmo2,
    "gemma3": DecoderConfig.gemma3,
}  # fmt: skip


def config_of(spec: str | DecoderConfig) -> DecoderConfig:
    """A preset name, a JSON file of `DecoderConfig` fields, or a config.

    Raises:
        ConfigError: neither a preset nor a readable JSON config file.
    """
    if isinstance(spec, DecoderConfig):
        return spec
    if isinstance(spec, str) and spec in PRESET_CONFIGS:
        return PRESET_CONFIGS[spec]()
    path = Path(str(spec))
    if not path.is_file():
        raise ConfigError(
            f"plan: config must be a preset {sorted(PRESET_CONFIGS)} or a JSON file "
            f"of DecoderConfig fields, got {spec!r}."
        )
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(f"plan: config {spec!r} is not readable JSON: {err}") from err
    if isinstance(fields, dict) and isinstance(fields.get("cfg"), dict):
        fields = fields["cfg"]  # DecoderLM.init_args() output
    if not isinstance(fields, dict):
        raise ConfigError(f"plan: config {spec!r} must hold a JSON object of fields.")
    if isinstance(fields.get("global_layers"), list):
        fields["global_layers"] = tuple(fields["global_layers"])
    try:
        return DecoderConfig(**fields)
    except TypeError as err:
        raise ConfigError(f"plan: config {spec!r}: {err}") from err


@dataclass(frozen=True)
class PlanResult:
    """Per-device bytes of one model on one mesh (see the module docstring)."""

    config: str
    mesh: dict
    rules: str
    batch: int
    seq_len: int
    precision: str
    num_params: int
    params_bytes: int
    opt_bytes: int
    total_params_bytes: int
    total_opt_bytes: int
    temp_bytes: int | None = None
    argument_bytes: int | None = None
    compiled: bool = False

    @property
    def devices(self) -> int:
        return int(np.prod(list(self.mesh.values())))

    def to_json(self) -> dict:
        return {**asdict(self), "devices": self.devices}

    def row(self) -> list[str]:
        gib = 2.0**30

        def f(b):
            return "-" if b is None else f"{b / gib:8.2f}"

        total = self.params_bytes + self.opt_bytes + (self.temp_bytes or 0)
        return [
            ",".join(f"{k}={v}" for k, v in self.mesh.items()), self.rules,
            f(self.params_bytes), f(self.opt_bytes), f(self.temp_bytes), f(total),
        ]  # fmt: skip

    def table(self) -> str:
        return plans_table([self])


def plans_table(results: list[PlanResult]) -> str:
    """The plans of one model as one table (a row per mesh)."""
    head = ["mesh", "rules", "params GiB", "Adam GiB", "temp GiB", "sum GiB"]
    rows = [head, *(r.row() for r in results)]
    widths = [max(len(r[i].strip()) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.strip().rjust(w) for c, w in zip(r, widths, strict=True))
             for r in rows]  # fmt: skip
    first = results[0]
    return (
        f"{first.config}: {first.num_params / 1e9:.2f} B parameters, batch "
        f"{first.batch} x {first.seq_len}, {first.precision}; per device:\n"
        + "\n".join(lines)
    )


def _per_device(shapes: Any, shardings: Any, mesh_shape: dict) -> int:
    total = 0
    for x, s in zip(
        jax.tree_util.tree_leaves(shapes),
        jax.tree_util.tree_leaves(shardings),
        strict=True,
    ):
        split = 1
        for entry in s.spec:
            for a in (entry,) if isinstance(entry, str) else entry or ():
                split *= mesh_shape[a]
        total += x.size * x.dtype.itemsize // split
    return total


def _abstract(cfg: DecoderConfig) -> Any:
    return eqx.filter_eval_shape(lambda k: DecoderLM(cfg, key=k), jax.random.key(0))


def plan(
    config: str | DecoderConfig,
    mesh: str | dict,
    *,
    rules: str = "fsdp",
    batch: int = 8,
    seq_len: int = 2048,
    precision: str = "bf16",
    compile: bool = False,  # noqa: A002 - the natural name
    timeout: float = 1800,
) -> PlanResult:
    """Per-device bytes of `config` on a mesh `mesh` (`"data=8,model=4"`).

    Args:
        config: a preset name (`PRESET_CONFIGS`), a JSON file, or a config.
        mesh: axis sizes.
        rules: a preset of `blocklab.training.placement` or a mapping.
        batch, seq_len: the global batch (sequences) and its length, for
            the compiled step's temporaries.
        precision: `"bf16"` (float32 parameters and state, bfloat16 compute)
            or `"float32"`.
        compile: also compile the training step for the mesh (in a child
            process with that many simulated devices) and read its
            temporaries.
        timeout: seconds for that child process.

    Raises:
        ConfigError: a bad config, mesh or rules (e.g. a dimension that does
            not divide over its mesh axis, named).
    """
    owner = "plan"
    name = config if isinstance(config, str) else "config"
    cfg = config_of(config)
    shape = parse_mesh(mesh)
    batch = check_int(owner, "batch", batch, min=1)
    seq_len = check_int(owner, "seq_len", seq_len, min=1)
    precision = check_choice(owner, "precision", precision, PRECISIONS)
    abstract = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    label = rules if isinstance(rules, str) else json.dumps(rules)
    resolve_rules(rules, abstract)
    optimizer = optax.adamw(1e-4)
    state = eqx.filter_eval_shape(init_state, _abstract(cfg), optimizer)
    shard = state_shardings(state, optimizer, abstract, rules)

    def arrays(tree):
        return [x for x in jax.tree_util.tree_leaves(tree) if hasattr(x, "dtype")]

    def shardings(tree):
        return [s for s in jax.tree_util.tree_leaves(tree) if hasattr(s, "spec")]

    params = _per_device(arrays(state.model), shardings(shard.model), shape)
    opt = _per_device(arrays(state.opt_state), shardings(shard.opt_state), shape)
    n_params = sum(x.size for x in arrays(state.model)
                   if jnp.issubdtype(x.dtype, jnp.inexact))  # fmt: skip
    tot_p = sum(x.size * x.dtype.itemsize for x in arrays(state.model))
    tot_o = sum(x.size * x.dtype.itemsize for x in arrays(state.opt_state))
    temp = args_bytes = None
    if compile:
        temp, args_bytes = _compiled_in_child(
            cfg, shape, rules, batch, seq_len, precision, timeout
        )
    return PlanResult(
        name, shape, label, batch, seq_len, precision, int(n_params), int(params),
        int(opt), int(tot_p), int(tot_o), temp, args_bytes, compile,
    )  # fmt: skip


def _compiled_in_child(cfg, shape, rules, batch, seq_len, precision, timeout):
    n = int(np.prod(list(shape.values())))
    payload = json.dumps({
        "config": cfg.to_dict(), "mesh": shape, "rules": rules, "batch": batch,
        "seq_len": seq_len, "precision": precision,
    })  # fmt: skip
    if jax.device_count() == n:
        return _compiled_memory(payload)
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={n}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    code = (
        "import sys; from blocklab.experiments.plan import _child; _child(sys.argv[1])"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-c", code, payload], env=env, capture_output=True,
            text=True, timeout=timeout,
        )  # fmt: skip
    except subprocess.TimeoutExpired as err:
        raise RuntimeError(
            f"plan: compiling for {n} devices took over {timeout} s"
        ) from err
    if out.returncode != 0:
        raise RuntimeError(
            f"plan: the compile for {n} devices failed:\n{out.stderr[-3000:]}"
        )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["temp"], res["args"]


def _child(payload: str) -> None:
    temp, args = _compiled_memory(payload)
    print(json.dumps({"temp": temp, "args": args}))


def _compiled_memory(payload: str) -> tuple[int, int]:
    """Compile one training step for the mesh on shapes; its memory analysis."""
    from ..training.mesh_training import shard_step
    from ..training.placement import ActivationConstraint, mesh_of
    from ..training.placement import with_constraints as _with_constraints
    from ..training.step import make_train_step

    p = json.loads(payload)
    fields = dict(p["config"])
    if isinstance(fields.get("global_layers"), list):
        fields["global_layers"] = tuple(fields["global_layers"])
    cfg = DecoderConfig(**fields)
    mesh = mesh_of(p["mesh"])
    rules, B, T, V = p["rules"], p["batch"], p["seq_len"], cfg.vocab_size

    def source(key):
        X = jax.random.randint(key, (B, T + 1), 0, V)
        return X[:, :-1], X[:, 1:]

    optimizer = optax.adamw(1e-4)
    step = shard_step(
        make_train_step(optimizer, source, precision=p["precision"]), mesh, rules
    )
    model = _with_constraints(
        _abstract(cfg), ActivationConstraint.of(resolve_rules(rules, mesh), mesh)
    )
    state = eqx.filter_eval_shape(init_state, model, optimizer)
    shard = state_shardings(state, optimizer, mesh, rules)
    dyn, static = eqx.partition(state, lambda x: isinstance(x, jax.ShapeDtypeStruct))
    dyn_shard = eqx.filter(shard, lambda s: s is not None, is_leaf=lambda x: x is None)
    key_sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def one(d, key):
        new, loss = step(eqx.combine(d, static), key)
        return eqx.filter(new, eqx.is_array), loss

    fn = jax.jit(
        one, in_shardings=(dyn_shard, key_sharding),
        out_shardings=(dyn_shard, key_sharding), donate_argnums=0,
    )  # fmt: skip
    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    stats = fn.lower(dyn, key).compile().memory_analysis()
    return int(stats.temp_size_in_bytes), int(stats.argument_size_in_bytes)
