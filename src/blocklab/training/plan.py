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

The model: a `DecoderConfig` (or a `DecoderLM`'s), or a preset of
`PRESET_CONFIGS` (`llama3-8b`, `llama3-70b` with the published sizes, and the
library's small family presets). A checkpoint folder, a `transformers`
`config.json` or a JSON file of `DecoderConfig` fields becomes a config
through `blocklab.interop.config_of` (as `blocklab plan --config PATH` does).

What training refuses, the plan refuses: a global batch that the mesh axes
of the logical `batch` axis do not divide (`train_model` splits the batch
over them, `blocklab.training.mesh_training.check_batch`), and a sequence
longer than the model's `max_len`.

A mesh axis the rules split nothing over (no parameter, optimizer state or
activation dimension is mapped to it, e.g. `model` under `fsdp`) is shown,
not refused: `train_model` accepts such a mesh, and every device along that
axis then holds, and computes, the same copy, so the figures are those of the
mesh without it. `PlanResult.unused_axes` names each (size > 1), the table
gives them a column and a note naming the presets that would use them
(`fsdp+tp` for `model`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

from .._validate import ConfigError, check_choice, check_int
from ..models import DecoderConfig, DecoderLM
from ..models.decoder_config import CONFIG_CLASSES
from ..nn.config import ffn_width
from .mesh_training import state_shardings
from .placement import ACTIVATION_AXES, PRESETS, parse_mesh, resolve_rules
from .step import PRECISIONS, init_state

__all__ = [
    "FIT_POLICIES",
    "PRESET_CONFIGS",
    "PlanResult",
    "StepOption",
    "StepPlan",
    "check_global_batch",
    "closed_form_temp",
    "measure_step",
    "parse_bytes",
    "plan",
    "plan_step",
    "plans_table",
    "step_flops",
]

#: The sequence length of a plan when none is given (or the model's `max_len`).
DEFAULT_SEQ_LEN = 2048
#: The global batch of a plan when none is given, rounded up to a multiple of
#: the devices that carry the batch.
DEFAULT_BATCH = 8

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


def _config(spec: Any, owner: str) -> DecoderConfig:
    """A `DecoderConfig`, or a preset name of `PRESET_CONFIGS` resolved.

    A checkpoint folder or a config file is read one layer up
    (`blocklab.interop.config_of`, which the CLI calls): training reads no
    folder.
    """
    if isinstance(spec, DecoderConfig):
        return spec
    if isinstance(spec, str) and spec in PRESET_CONFIGS:
        return PRESET_CONFIGS[spec]()
    raise ConfigError(
        f"{owner}: the model must be a DecoderConfig, a DecoderLM or a preset "
        f"({', '.join(sorted(PRESET_CONFIGS))}); got {spec!r}. For a checkpoint "
        "folder or a config file, pass blocklab.interop.config_of(path)."
    )


def _batch_devices(mesh: str | dict, rules: Any) -> tuple[tuple[str, ...], int]:
    """The mesh axes that carry the batch under `rules`, and their devices.

    `train_model` splits each batch along its leading axis over the mesh
    axes of the logical `batch` axis (`resolve_rules(rules, mesh)["batch"]`:
    `data` and `expert`, whichever the mesh has, for the presets).
    """
    shape = parse_mesh(mesh)
    abstract = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    axes = tuple(resolve_rules(rules, abstract).get("batch", ()))
    return axes, int(np.prod([shape[a] for a in axes], dtype=np.int64))


def check_global_batch(
    batch: int, mesh: str | dict, rules: Any = "fsdp", *, name: str = "batch"
) -> int:
    """`batch` (sequences), refused where `train_model` refuses it on `mesh`.

    `train_model` splits each batch over the mesh axes that carry it (`data`
    and `expert` for the presets) and refuses a batch that the product of
    their sizes does not divide (`blocklab.training.mesh_training.check_batch`);
    this is that rule on a mesh given by its shape.

    Raises:
        ConfigError: `batch` not an int >= 1, or not a multiple of that
            product (naming `name`, the value, the axes and the multiples
            around it).
    """
    batch = check_int("plan", name, batch, min=1)
    axes, n = _batch_devices(mesh, rules)
    if batch % n:
        below = batch // n * n
        near = [m for m in (below, below + n) if m > 0]
        raise ConfigError(
            f"plan: {name}={batch} sequences do not split over mesh axes "
            f"{axes!r} ({n} devices) of mesh {parse_mesh(mesh)}, which carry the "
            f"batch under rules {rules!r}; train_model refuses such a batch. Use a "
            f"multiple of {n} ({' or '.join(map(str, near))})."
        )
    return batch


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
    #: Mesh axes (name -> size, size > 1) the rules split nothing over: every
    #: device along one holds the same copy (see the module docstring).
    unused_axes: dict = field(default_factory=dict)

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
        unused = ",".join(f"{k}={v}" for k, v in self.unused_axes.items()) or "-"
        return [
            ",".join(f"{k}={v}" for k, v in self.mesh.items()), self.rules,
            str(self.batch), f(self.params_bytes), f(self.opt_bytes),
            f(self.temp_bytes), f(total), unused,
        ]  # fmt: skip

    def table(self) -> str:
        return plans_table([self])


def plans_table(results: list[PlanResult]) -> str:
    """The plans of one model as one table (a row per mesh)."""
    head = ["mesh", "rules", "batch", "params GiB", "Adam GiB", "temp GiB",
            "sum GiB", "unused"]  # fmt: skip
    rows = [head, *(r.row() for r in results)]
    widths = [max(len(r[i].strip()) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.strip().rjust(w) for c, w in zip(r, widths, strict=True))
             for r in rows]  # fmt: skip
    first = results[0]
    notes = [_unused_note(r) for r in results if r.unused_axes]
    return (
        f"{first.config}: {first.num_params / 1e9:.2f} B parameters, sequences "
        f"of {first.seq_len}, {first.precision}; per device:\n"
        + "\n".join(lines + list(dict.fromkeys(notes)))
    )


def _unused_note(r: PlanResult) -> str:
    """Why a row has unused axes, and the presets that would use them."""
    mesh = ",".join(f"{k}={v}" for k, v in r.mesh.items())
    fixes = []
    for axis in r.unused_axes:
        presets = [p for p, m in PRESETS.items() if axis in m.values()]
        if presets and all(p.strip() in PRESETS for p in r.rules.split("+")):
            fixes.append(f"rules {r.rules}+{presets[0]} would split over {axis!r}")
        else:
            fixes.append(f"a rules mapping naming {axis!r} would split over it")
    return (
        f"unused on {mesh} under rules {r.rules}: nothing is split over "
        f"{', '.join(repr(a) for a in r.unused_axes)}, so every device along it "
        f"holds and computes the same copy (the figures are those of the mesh "
        f"without it); {'; '.join(fixes)}."
    )


def _per_device(shapes: Any, shardings: Any, mesh_shape: dict) -> int:
    total = 0
    for x, s in zip(
        jax.tree_util.tree_leaves(shapes),
        jax.tree_util.tree_leaves(shardings),
        strict=True,
    ):
        split = 1
        for a in _spec_axes(s.spec):
            split *= mesh_shape[a]
        total += x.size * x.dtype.itemsize // split
    return total


def _abstract(cfg: DecoderConfig) -> Any:
    return eqx.filter_eval_shape(lambda k: DecoderLM(cfg, key=k), jax.random.key(0))


def plan(
    config: str | DecoderConfig,
    mesh: str | dict,
    *,
    rules: str | dict = "fsdp",
    batch: int | None = None,
    seq_len: int | None = None,
    precision: str = "bf16",
    compile: bool = False,  # noqa: A002 - the natural name
    timeout: float = 1800,
) -> PlanResult:
    """Per-device bytes of `config` on a mesh `mesh` (`"data=8,model=4"`).

    Args:
        config: a `DecoderConfig` or a preset name (`PRESET_CONFIGS`); a
            folder or file through `blocklab.interop.config_of`.
        mesh: axis sizes.
        rules: a preset of `blocklab.training.placement` or a mapping.
        batch, seq_len: the global batch (sequences) and its length, for
            the compiled step's temporaries; refused where `train_model`
            refuses them (`check_global_batch`; a `seq_len` above `max_len`).
            `None`: the smallest multiple of the devices carrying the batch
            that is at least `DEFAULT_BATCH` (8); the model's `max_len`, at
            most `DEFAULT_SEQ_LEN` (2048).
        precision: `"bf16"` (float32 parameters and state, bfloat16 compute)
            or `"float32"`.
        compile: also compile the training step for the mesh (in a child
            process with that many simulated devices) and read its
            temporaries.
        timeout: seconds for that child process.

    Returns:
        A `PlanResult`; its `unused_axes` name the mesh axes the rules split
        nothing over.

    Raises:
        ConfigError: a bad config, mesh, rules, batch or length (e.g. a
            dimension that does not divide over its mesh axis, named).
    """
    owner = "plan"
    name = config if isinstance(config, str) else "config"
    cfg = _config(config, "plan")
    shape = parse_mesh(mesh)
    if seq_len is None:
        seq_len = min(DEFAULT_SEQ_LEN, cfg.max_len)
    seq_len = check_int(owner, "seq_len", seq_len, min=1)
    if seq_len > cfg.max_len:
        raise ConfigError(
            f"{owner}: seq_len={seq_len} is longer than the model's max_len="
            f"{cfg.max_len} (DecoderLM, and so train_model, refuses longer "
            f"sequences); use a seq_len <= {cfg.max_len}."
        )
    precision = check_choice(owner, "precision", precision, PRECISIONS)
    abstract = jax.sharding.AbstractMesh(tuple(shape.values()), tuple(shape))
    label = rules if isinstance(rules, str) else json.dumps(rules)
    resolved = resolve_rules(rules, abstract)
    if batch is None:
        n = _batch_devices(shape, rules)[1]
        batch = -(-DEFAULT_BATCH // n) * n
    batch = check_global_batch(batch, shape, rules)
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
    used = {a for s in shardings(shard) for a in _spec_axes(s.spec)}
    used |= {a for n in ACTIVATION_AXES for a in resolved.get(n, ())}
    unused = {a: n for a, n in shape.items() if n > 1 and a not in used}
    temp = args_bytes = None
    if compile:
        temp, args_bytes = _compiled_in_child(
            cfg, shape, rules, batch, seq_len, precision, timeout
        )
    return PlanResult(
        name, shape, label, batch, seq_len, precision, int(n_params), int(params),
        int(opt), int(tot_p), int(tot_o), temp, args_bytes, compile, unused,
    )  # fmt: skip


def _spec_axes(spec: Any) -> list[str]:
    """The mesh axes a `PartitionSpec` splits over."""
    return [a for entry in spec
            for a in ((entry,) if isinstance(entry, str) else entry or ())]  # fmt: skip


def _compiled_in_child(cfg, shape, rules, batch, seq_len, precision, timeout):
    n = int(np.prod(list(shape.values())))
    payload = json.dumps({
        "config": cfg.to_dict(), "cfg_class": type(cfg).__name__, "mesh": shape,
        "rules": rules, "batch": batch, "seq_len": seq_len, "precision": precision,
    })  # fmt: skip
    if jax.device_count() == n:
        return _compiled_memory(payload)
    env = {
        **os.environ,
        "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} "
        f"--xla_force_host_platform_device_count={n}".strip(),
        "JAX_PLATFORMS": "cpu",
    }
    code = "import sys; from blocklab.training.plan import _child; _child(sys.argv[1])"
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
    from .mesh_training import shard_step
    from .placement import ActivationConstraint, mesh_of
    from .placement import with_constraints as _with_constraints
    from .step import make_train_step

    p = json.loads(payload)
    cfg = CONFIG_CLASSES[p["cfg_class"]](**p["config"])
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


# Fitting a training step to a memory budget ---------------------------------

#: The policies `plan_step` compares by default (`"offload:..."` is measured
#: only where the backend has host memory apart from the device's).
FIT_POLICIES = ("none", "dots", "full", "nested")

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_bytes(value: Any, *, name: str = "memory_budget") -> int:
    """Bytes from an int or a string such as `"16GiB"`, `"500MB"`, `"1e9"`.

    Raises:
        ConfigError: anything else, or a value <= 0.
    """
    text = str(value).strip().lower().replace(" ", "")
    num = text.rstrip("kmgtib")
    unit = text[len(num) :]
    try:
        if isinstance(value, bool) or unit not in _UNITS or not num:
            raise ValueError
        out = int(float(num) * _UNITS[unit])
    except (ValueError, OverflowError):
        raise ConfigError(
            f"plan_step: {name} must be a number of bytes (an int, or a string "
            f"like '16GiB', '500MB'), got {value!r}."
        ) from None
    if out <= 0:
        raise ConfigError(f"plan_step: {name} must be positive, got {value!r}.")
    return out


def _gib(b: int | float) -> str:
    return f"{b / 2**30:.3f}"


@dataclass(frozen=True)
class StepOption:
    """One policy x microbatch count of `plan_step`.

    Attributes:
        remat: the policy (`blocklab.nn.remat`).
        microbatches: microbatches per step.
        bytes: what the step needs on the device: its arguments (parameters,
            optimizer state, batch), its temporaries and its outputs not
            aliased to donated arguments.
        temp_bytes: the temporaries alone (activations saved for the
            backward pass, gradients, the accumulator).
        flops: the step's FLOPs, recomputation included (closed form).
        seconds: estimated step time, `flops / peak_flops`.
        measured: the bytes come from the compiled step's memory analysis
            (else from the closed form).
        fits: `bytes <= budget`.
    """

    remat: str
    microbatches: int
    bytes: int
    temp_bytes: int
    flops: float
    seconds: float
    measured: bool
    fits: bool

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepPlan:
    """`plan_step`'s options and its choice (the fastest that fits)."""

    config: str
    batch: int
    seq_len: int
    precision: str
    budget: int
    peak_flops: float
    options: tuple[StepOption, ...]
    choice: StepOption

    def to_json(self) -> dict:
        return {
            **{k: v for k, v in asdict(self).items() if k not in ("options", "choice")},
            "options": [o.to_json() for o in self.options],
            "choice": self.choice.to_json(),
        }

    def table(self) -> str:
        big = max(o.bytes for o in self.options) >= 2**30
        unit, scale = ("GiB", 2**30) if big else ("MiB", 2**20)
        head = ["remat", "microbatches", unit, f"temp {unit}", "est. s/step",
                "from", "fits", ""]  # fmt: skip
        rows = [head]
        for o in self.options:
            rows.append([
                o.remat, str(o.microbatches), f"{o.bytes / scale:.3f}",
                f"{o.temp_bytes / scale:.3f}",
                f"{o.seconds:.4g}", "compiled" if o.measured else "closed form",
                "yes" if o.fits else "no", "<- chosen" if o == self.choice else "",
            ])  # fmt: skip
        widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                 for r in rows]  # fmt: skip
        return (
            f"{self.config}: batch {self.batch} x {self.seq_len}, {self.precision}, "
            f"budget {_gib(self.budget)} GiB; time at {self.peak_flops / 1e12:.3g} "
            "TFLOP/s:\n" + "\n".join(lines)
        )


def _sizes(cfg: DecoderConfig) -> tuple[int, int, int, int, int, int]:
    d, H, KV, p = cfg.num_hiddens, cfg.num_heads, cfg.block.num_kv_heads, cfg.head_dim
    F = cfg.ffn_width if cfg.ffn_width is not None else ffn_width(d, cfg.act)
    return d, H, KV or H, p, F, cfg.vocab_size


def step_flops(cfg: DecoderConfig, batch: int, seq_len: int, remat: str) -> float:
    r"""FLOPs of one training step (closed form), recomputation included.

    Forward per token: per block $2d(Hp + 2\,KV p) + 2Hpd$ (projections),
    $2 c\, d F$ ($c = 3$ gated, 2 not: the FFN) and $4 T H p$ (scores and
    mixing over every key); the head $2dV$. The backward pass is twice the
    forward. Rematerialization adds the recomputed forward: `"full"` one
    forward of the blocks, `"nested"` two, `"dots"` (and names) the
    attention's products; `"none"` nothing.
    """
    d, H, KV, p, F, V = _sizes(cfg)
    gated = cfg.act in ("swiglu", "geglu", "reglu", "bilinear")
    attn = 4 * seq_len * H * p
    block = 2 * d * (H * p + 2 * KV * p) + 2 * H * p * d + (6 if gated else 4) * d * F
    blocks = cfg.num_blks * (block + attn)
    forward = (blocks + 2 * d * V) * batch * seq_len
    extra = {"none": 0.0, "full": 1.0, "nested": 2.0}.get(remat)
    if extra is None:  # dots, names, offload: the attention is recomputed
        recompute = cfg.num_blks * attn * batch * seq_len
    else:
        recompute = extra * blocks * batch * seq_len
    return 3.0 * forward + recompute


def _residuals_per_token(cfg: DecoderConfig, remat: str, seq_len: int) -> int | float:
    """Elements one block keeps per token for the backward pass (closed form).

    `"none"`: the block's input, both norms' outputs, q, k, v and their
    rotated copies, the attention's output and log-sum-exp, the two branch
    outputs and the residual in between, and the FFN's pre-activations,
    activation and product; `"dots"`: the input and the weight products'
    outputs; `"full"`, `"nested"`: the input (`nested` is counted by the
    caller); names: the input and each named site. On the reference
    attention path (the `"auto"` choice below 1024 keys) `"none"` also keeps
    the `(H, T)` logits and weights of each query, about $4.5 H T$ elements
    (fitted to XLA:CPU's figures; on the chunked path XLA keeps about 1.6x
    the list above).
    """
    from ..nn.attention_impls import AUTO_MIN_CHUNKED_LEN

    d, H, KV, p, F, _ = _sizes(cfg)
    gated = cfg.act in ("swiglu", "geglu", "reglu", "bilinear")
    qkv = H * p + 2 * KV * p
    ffn = (4 if gated else 2) * F
    if remat == "none":
        impl = cfg.block.attention_impl
        reference = impl == "reference" or (
            impl == "auto" and seq_len < AUTO_MIN_CHUNKED_LEN
        )
        base = 6 * d + qkv + (H * p + KV * p) + H * p + H + ffn
        # the chunked kernel's per-block copies: 1.6x (fitted likewise)
        return base + 4.5 * H * seq_len if reference else 1.6 * base
    if remat == "dots":
        return d + qkv + d + (2 if gated else 1) * F + d
    if remat.startswith(("names:", "offload:")):
        size = {"attn.hook_q": H * p, "attn.hook_k": KV * p, "attn.hook_v": KV * p,
                "attn.hook_rot_q": H * p, "attn.hook_rot_k": KV * p,
                "attn.hook_z": H * p, "mlp.hook_pre": F, "mlp.hook_pre_linear": F,
                "mlp.hook_post": F}  # fmt: skip
        names = remat.partition(":")[2].split(",")
        kept = 0 if remat.startswith("offload:") else 1
        return d + kept * sum(size.get(n, d) for n in names)
    return d


def closed_form_temp(
    cfg: DecoderConfig,
    batch: int,
    seq_len: int,
    remat: str,
    microbatches: int = 1,
    precision: str = "float32",
) -> int:
    r"""The step's temporaries in bytes, in closed form.

    With $b$ the compute dtype's bytes, $B_m = B/k$ rows per microbatch,
    $r$ the elements one block keeps per token (`_residuals_per_token`) and
    $r_0$ those of `"none"`:
    $$\text{temp} \approx b\,B_m T\,\bigl(N_s r + [\text{remat}]\, r_0
    + 3V\bigr) + P_4 (1 + [k > 1]),$$
    where $N_s = N$ blocks ($\lceil N/g\rceil + g$ block inputs for
    `"nested"`), the bracket adds one block's full activations while it is
    recomputed, $3V$ the logits, their softmax and gradient, and $P_4$ the
    float32 gradients (and the accumulator over microbatches).
    """
    from ..nn.remat import nested_groups

    b = 2 if precision == "bf16" else 4
    rows = batch // microbatches * seq_len
    N = cfg.num_blks
    r0 = _residuals_per_token(cfg, "none", seq_len)
    if remat == "nested":
        g, G, rest = nested_groups(N)
        kept = (G + (1 if rest else 0) + g) * cfg.num_hiddens + r0
    else:
        kept = N * _residuals_per_token(cfg, remat, seq_len)
        kept += r0 if remat != "none" else 0
    params = sum(
        x.size * 4
        for x in jax.tree_util.tree_leaves(_abstract(cfg))
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)
    )
    act = b * rows * (kept + 3 * cfg.vocab_size)
    return int(act + params * (2 if microbatches > 1 else 1))


def _machine_bytes() -> int:
    """Memory of this machine's first device: the GPU's limit, or the host's RAM."""
    dev = jax.devices()[0]
    stats = getattr(dev, "memory_stats", lambda: None)()
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return 0


def measure_step(
    model: Any,
    batch: int,
    seq_len: int,
    remat: Any,
    microbatches: int = 1,
    precision: str = "float32",
    optimizer: Any = None,
) -> dict:
    """Compile the training step `train_model` runs (on shapes: nothing is
    allocated) and read its memory analysis.

    The step is `make_train_step(optimizer, source, precision=...,
    microbatches=...)` of the next-token loss on `(batch, seq_len)` token
    ids, on `with_remat(model, remat)`, jitted with the state donated.

    Returns:
        `{"bytes", "temp_bytes", "argument_bytes", "output_bytes",
        "alias_bytes"}`; `bytes` = arguments + temporaries + outputs not
        aliased to the donated arguments.
    """
    from ..nn.remat import with_remat
    from .step import make_train_step

    optimizer = optax.adamw(1e-4) if optimizer is None else optimizer
    if isinstance(model, DecoderConfig):
        model = _abstract(model)
    model = with_remat(model, remat)
    V = model.cfg.vocab_size

    def source(key):
        X = jax.random.randint(key, (batch, seq_len + 1), 0, V)
        return X[:, :-1], X[:, 1:]

    step = make_train_step(
        optimizer, source, precision=precision, microbatches=microbatches
    )
    state = eqx.filter_eval_shape(init_state, model, optimizer)
    dyn, static = eqx.partition(
        state, lambda x: isinstance(x, jax.ShapeDtypeStruct) or eqx.is_array(x)
    )
    dyn = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), dyn)

    def one(d, key):
        new, loss = step(eqx.combine(d, static), key)
        return eqx.filter(new, eqx.is_array), loss

    key = jax.ShapeDtypeStruct((), jax.random.key(0).dtype)
    stats = jax.jit(one, donate_argnums=0).lower(dyn, key).compile().memory_analysis()
    args, temp = int(stats.argument_size_in_bytes), int(stats.temp_size_in_bytes)
    out, alias = int(stats.output_size_in_bytes), int(stats.alias_size_in_bytes)
    return {
        "bytes": args + temp + max(out - alias, 0), "temp_bytes": temp,
        "argument_bytes": args, "output_bytes": out, "alias_bytes": alias,
    }  # fmt: skip


def plan_step(
    model: Any,
    batch_shape: tuple[int, int],
    memory_budget: int | str,
    *,
    policies: Any = None,
    microbatches: Any = None,
    precision: str = "float32",
    measure: bool | None = None,
    peak_flops: float | None = None,
) -> StepPlan:
    r"""The fastest rematerialization policy and microbatch count that fit.

    Every policy (`FIT_POLICIES`, or `policies`) times every microbatch count
    $k$ (the powers of two that divide the batch, or `microbatches`) is sized:
    measured, by compiling the training step `train_model` runs for it
    (`measure_step`: the compiled program's memory analysis on this machine)
    when the model fits this machine (parameters, gradients and AdamW's two
    moments within its memory), else in closed form (`plan`'s parameter and
    optimizer bytes plus `closed_form_temp`). Its time is estimated as
    `step_flops / peak_flops`. The choice is the option of least time among
    those with bytes $\le$ the budget, fewer microbatches first among equal
    times.

    Args:
        model: a `DecoderLM`, or what `plan` takes (a `DecoderConfig` or a
            preset name; a folder or file through `blocklab.interop.config_of`).
        batch_shape: `(batch, seq_len)` of the step's token ids.
        memory_budget: bytes (an int, or `"16GiB"`, `"500MB"`).
        policies: the `remat=` values to compare.
        microbatches: the microbatch counts to compare (each divides batch).
        precision: `"float32"` or `"bf16"`.
        measure: `True` compiles, `False` uses the closed form, `None`
            decides as above.
        peak_flops: the device's FLOP/s for the time estimate (default:
            this machine's float32 matmul rate, measured).

    Returns:
        A `StepPlan` (`.table()`, `.to_json()`, `.choice`).

    Raises:
        ConfigError: bad arguments (a microbatch count that does not divide
            the batch, an unknown policy), or a budget below every option
            (naming the smallest need and its option).
    """
    from ..nn.remat import parse_remat

    owner = "plan_step"
    if isinstance(model, DecoderLM):
        cfg, name = model.cfg, "model"
    else:
        cfg = _config(model, "plan_step")
        name = model if isinstance(model, str) else "config"
        model = None
    if not isinstance(batch_shape, (tuple, list)) or len(batch_shape) != 2:
        raise ConfigError(
            f"{owner}: batch_shape must be (batch, seq_len), got {batch_shape!r}."
        )
    B = check_int(owner, "batch_shape[0]", batch_shape[0], min=1)
    T = check_int(owner, "batch_shape[1]", batch_shape[1], min=1)
    if T > cfg.max_len:
        raise ConfigError(
            f"{owner}: seq_len={T} is longer than the model's max_len={cfg.max_len}."
        )
    budget = parse_bytes(memory_budget)
    precision = check_choice(owner, "precision", precision, PRECISIONS)
    pols = list(FIT_POLICIES if policies is None else policies)
    if policies is None and jax.default_backend() != "cpu":
        pols.append("offload:mlp.hook_post,attn.hook_q,attn.hook_k,attn.hook_v")
    pols = [str(parse_remat(owner, p)) for p in pols]
    if microbatches is None:
        ks = [k for k in (1, 2, 4, 8, 16, 32, 64) if k <= B and B % k == 0]
    else:
        ks = [check_int(owner, "microbatches", k, min=1) for k in microbatches]
        for k in ks:
            if B % k:
                raise ConfigError(
                    f"{owner}: microbatches={k} does not divide the batch ({B})."
                )
    abstract = _abstract(cfg) if model is None else model
    arrays = [x for x in jax.tree_util.tree_leaves(abstract) if hasattr(x, "dtype")]
    params = sum(x.size * x.dtype.itemsize for x in arrays)
    if measure is None:
        measure = 4 * params < _machine_bytes()
    peak = float(peak_flops) if peak_flops is not None else _peak_flops()
    options = []
    for pol in pols:
        flops = step_flops(cfg, B, T, pol)
        for k in ks:
            if measure:
                m = measure_step(abstract, B, T, pol, k, precision)
                need, temp = m["bytes"], m["temp_bytes"]
            else:
                temp = closed_form_temp(cfg, B, T, pol, k, precision)
                # parameters, AdamW's two moments and its count, the batch
                need = 3 * params + temp + 2 * B * T * 4
            options.append(
                StepOption(
                    pol,
                    k,
                    int(need),
                    int(temp),
                    flops,
                    flops / peak,
                    bool(measure),
                    need <= budget,
                )  # fmt: skip
            )
    fitting = [o for o in options if o.fits]
    if not fitting:
        least = min(options, key=lambda o: o.bytes)
        raise ConfigError(
            f"{owner}: memory_budget={budget} bytes ({_gib(budget)} GiB) is below "
            f"every option; the smallest need is {least.bytes} bytes "
            f"({_gib(least.bytes)} GiB: remat={least.remat!r}, microbatches="
            f"{least.microbatches}). Raise the budget, or shorten the batch."
        )
    choice = min(fitting, key=lambda o: (o.seconds, o.microbatches))
    return StepPlan(name, B, T, precision, budget, peak, tuple(options), choice)


def _peak_flops(n: int = 1024, reps: int = 3) -> float:
    """This machine's float32 matmul rate: $2n^3$ over the best of `reps` timed
    $n \\times n$ products (after one compile-and-warm call)."""
    import time

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    matmul = jax.jit(jnp.matmul)
    matmul(a, a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        matmul(a, a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best
