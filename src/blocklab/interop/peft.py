"""LoRA adapters in Hugging Face PEFT's format, both ways, without torch.

A PEFT LoRA folder holds `adapter_config.json` and `adapter_model.safetensors`
with keys `base_model.model.<module path>.lora_{A,B}.weight`, A `(r, in)`
and B `(out, r)` per module, and scale `lora_alpha / r` (or `/ sqrt(r)` with
`use_rslora`), per module overridden by `rank_pattern` / `alpha_pattern`
(the first key `k` with `re.match("(.*\\.)?(k)$", name)`).

The module paths come from the family's state-dict rules
(`blocklab.interop.hf_common`): a per-layer rule mapping one Hugging Face
`<module>.weight` to one blocklab `<attention|ffn>.W_*.weight` names an
adaptable module (`"same"` layout: `nn.Linear`; `"T"`: GPT-2's `Conv1D`,
which PEFT adapts with `fan_in_fan_out=True`). Fused projections (GPT-2's
`c_attn`, Phi-3's `qkv_proj`), embeddings, the head and MoE experts are
refused by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._io import atomic_dir
from .._validate import ConfigError, check_bool
from ..nn.lora import LORA_TARGETS, LoRALinear, _add, lora_config, lora_layers
from .hf_common import Family, resolve_family

__all__ = ["save_adapter", "load_adapter"]

_PREFIX = "base_model.model."
_CONFIG = "adapter_config.json"
_WEIGHTS = "adapter_model.safetensors"

#: Config fields that change the maths, with the value that means "off".
_OFF = {
    "use_dora": False,
    "use_qalora": False,
    "use_bdlora": False,
    "lora_bias": False,
    "modules_to_save": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "layer_replication": None,
    "target_parameters": None,
    "trainable_token_indices": None,
    "alora_invocation_tokens": None,
    "exclude_modules": None,
    "megatron_config": None,
}


def _modules(fam: Family, cfg: Any) -> dict[str, tuple[str, str]]:
    """Hugging Face module path within a layer (`"self_attn.q_proj"`) ->
    (blocklab target name, rule layout) for the adaptable modules."""
    by_tail = {tail: name for name, tail in LORA_TARGETS.items()}
    out = {}
    for rule in fam.layer_rules(cfg):
        if len(rule.bl) != 1 or not rule.hf.endswith(".weight"):
            continue
        parts = tuple(rule.bl[0].split("."))
        if parts[-1] != "weight" or parts[:-1] not in by_tail:
            continue
        if rule.kind in ("same", "T"):
            out[rule.hf[: -len(".weight")]] = (by_tail[parts[:-1]], rule.kind)
    return out


def _family(owner: str, model: Any, family: str | None) -> Family:
    cfg = getattr(model, "cfg", None)
    if cfg is None or not hasattr(model, "stack"):
        raise ConfigError(
            f"{owner}: model must be a DecoderLM (with .cfg and .stack), got "
            f"{type(model).__name__}."
        )
    return resolve_family(owner, cfg, family, check=True)


def save_adapter(
    model: Any,
    path: str | os.PathLike,
    *,
    family: str | None = None,
    base_model_name_or_path: str | None = None,
    overwrite: bool = False,
) -> Path:
    """Write the adapters of `model` as a PEFT LoRA folder.

    `peft.PeftModel.from_pretrained(hf_model, path)` on the `transformers`
    model of the base then computes the adapted model's logits. Tensors are
    float32; `r`, `lora_alpha`, `use_rslora` and `lora_dropout` are the
    adapter's `LoRAConfig`, read from its leaves (`blocklab.nn.lora.lora_config`:
    the rank and alpha of most modules); the modules that differ go to
    `rank_pattern` / `alpha_pattern`; `target_modules` are the module paths
    within a layer (`"self_attn.q_proj"`), so that GPT-2's two `c_proj` stay
    apart.

    Args:
        model: a `DecoderLM` with `LoRALinear` adapters (`blocklab.lora`).
        path: the folder to write (written atomically).
        family: the `transformers` family (inferred from `model.cfg` if None).
        base_model_name_or_path: recorded in the config (metadata).
        overwrite: replace an existing non-empty folder.

    Returns:
        The folder's path.
    """
    owner = "save_adapter"
    overwrite = check_bool(owner, "overwrite", overwrite)
    fam = _family(owner, model, family)
    layers = lora_layers(model)
    if not layers:
        raise ConfigError(f"{owner}: the model has no adapters (see blocklab.lora).")
    modules = _modules(fam, model.cfg)
    by_target = {t: m for m, (t, _) in modules.items()}
    tensors: dict[str, np.ndarray] = {}
    ranks: dict[str, int] = {}
    alphas: dict[str, float] = {}
    rslora = set()
    used_kinds = set()
    for where, node in layers.items():
        parts = where.split(".")
        target = next(
            (t for t, tail in LORA_TARGETS.items() if tuple(parts[-2:]) == tail), None
        )
        if parts[:2] != ["stack", "blocks"] or target not in by_target:
            raise ConfigError(
                f"{owner}: the adapter on {where} has no PEFT module in the "
                f"{fam.name} family (adaptable: {sorted(by_target)})."
            )
        module = by_target[target]
        used_kinds.add(modules[module][1])
        ranks[module], alphas[module] = node.rank, node.alpha
        rslora.add(node.use_rslora)
        A = np.asarray(jax.device_get(node.A), np.float32)
        B = np.asarray(jax.device_get(node.B), np.float32)
        for i in range(A.shape[0]):
            name = _PREFIX + fam.layer_prefix.format(i=i) + module
            tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(A[i])
            tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(B[i])
    if len(rslora) > 1 or len(used_kinds) > 1:
        what = "use_rslora" if len(rslora) > 1 else "fan_in_fan_out"
        raise ConfigError(
            f"{owner}: PEFT has one {what} per adapter; this model's adapters "
            "mix both settings."
        )
    # The adapter's own settings, read from its leaves; the modules that
    # differ from them go to rank_pattern / alpha_pattern.
    settings = lora_config(model)
    r, alpha = settings.rank, settings.alpha
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": r,
        "lora_alpha": alpha,
        "target_modules": sorted(ranks),
        "rank_pattern": {m: v for m, v in sorted(ranks.items()) if v != r},
        "alpha_pattern": {m: v for m, v in sorted(alphas.items()) if v != alpha},
        "use_rslora": settings.use_rslora,
        "fan_in_fan_out": used_kinds.pop() == "T",
        "lora_dropout": settings.dropout,
        "bias": "none",
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "use_dora": False,
    }
    from safetensors.numpy import save_file

    with atomic_dir(path, owner=owner, overwrite=overwrite) as tmp:
        (tmp / _CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / _WEIGHTS), metadata={"format": "pt"})
    return Path(path)


def _pattern(patterns: Mapping[str, Any], name: str, default: Any) -> Any:
    """PEFT's `get_pattern_key`: the value of the first key `k` with
    `re.match("(.*\\.)?(k)$", name)`, else `default`."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


def _targeted(targets: Any, name: str) -> bool:
    """PEFT's `check_target_module_exists` for `target_modules`."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _read(owner: str, folder: Path) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    cfg_file, weights = folder / _CONFIG, folder / _WEIGHTS
    for f in (cfg_file, weights):
        if not f.is_file():
            raise ConfigError(f"{owner}: {f} is missing (not a PEFT adapter folder).")
    try:
        config = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{owner}: {cfg_file} is not valid JSON: {e}.") from e
    if not isinstance(config, dict):
        raise ConfigError(f"{owner}: {cfg_file} must hold a JSON object.")
    from safetensors.numpy import load_file

    return config, load_file(str(weights))


def load_adapter(
    model: Any, path: str | os.PathLike, *, family: str | None = None
) -> Any:
    """Add the LoRA adapter of a PEFT folder to `model` (its base).

    Reads `r`, `lora_alpha`, `target_modules`, `use_rslora`, `rank_pattern`
    and `alpha_pattern`; the tensors give each module's rank, which must
    agree with the config. `lora_dropout` acts in training only and is not
    applied. The result's logits equal `PeftModel.from_pretrained`'s on the
    `transformers` base.

    Raises:
        ConfigError: a setting blocklab does not implement, named (DoRA
            `use_dora`, `modules_to_save`, `layers_to_transform`, `bias`
            other than `"none"`, a `fan_in_fan_out` that does not match the
            module type, ...); a tensor for a module this family cannot adapt
            or does not have (another architecture), a layer missing, a
            shape that does not match the model, a target that names
            nothing; a model that already has adapters.
    """
    owner = "load_adapter"
    fam = _family(owner, model, family)
    folder = Path(path)
    config, tensors = _read(owner, folder)
    if config.get("peft_type") != "LORA":
        raise ConfigError(
            f"{owner}: peft_type must be 'LORA', got {config.get('peft_type')!r}."
        )
    for field, off in _OFF.items():
        value = config.get(field, off)
        if value not in (off, None, False, [], {}):
            raise ConfigError(
                f"{owner}: {field}={value!r} is not supported (it changes the "
                "maths); only plain LoRA adapters load."
            )
    if config.get("bias", "none") != "none":
        raise ConfigError(
            f"{owner}: bias={config['bias']!r} is not supported (trained biases); "
            "only bias='none' loads."
        )
    r, alpha = config.get("r"), config.get("lora_alpha")
    for name, v in (("r", r), ("lora_alpha", alpha)):
        if (
            isinstance(v, bool)
            or not isinstance(v, (int, float))
            or not math.isfinite(v)
        ):
            raise ConfigError(f"{owner}: {name} must be a finite number, got {v!r}.")
    use_rslora = bool(config.get("use_rslora", False))
    targets = config.get("target_modules")
    if not isinstance(targets, (str, list)) or not targets:
        raise ConfigError(
            f"{owner}: target_modules must be a list or a regex string, got "
            f"{targets!r}."
        )
    rank_pattern = config.get("rank_pattern") or {}
    alpha_pattern = config.get("alpha_pattern") or {}

    modules = _modules(fam, model.cfg)
    L = model.cfg.num_blks
    found: dict[str, dict[int, dict[str, np.ndarray]]] = {}
    key_re = re.compile(r"(.+)\.lora_([AB])(?:\.default)?\.weight")
    for k, v in tensors.items():
        m = key_re.fullmatch(k)
        full = m.group(1) if m and k.startswith(_PREFIX) else None
        hit = None
        if full is not None:
            full = full[len(_PREFIX) :]
            for i in range(L):
                prefix = fam.layer_prefix.format(i=i)
                if full.startswith(prefix) and full[len(prefix) :] in modules:
                    hit = (full[len(prefix) :], i)
        if hit is None:
            raise ConfigError(
                f"{owner}: tensor {k!r} names no module of this {fam.name} model "
                f"with {L} layers that blocklab adapts (per-layer modules: "
                f"{sorted(modules)}); an adapter for another architecture?"
            )
        found.setdefault(hit[0], {}).setdefault(hit[1], {})[m.group(2)] = v
    if isinstance(targets, list):
        names = [fam.layer_prefix.format(i=i) + mod for mod in found for i in range(L)]
        for t in targets:
            if not any(_targeted([t], n) for n in names):
                raise ConfigError(
                    f"{owner}: target_modules entry {t!r} names no module with "
                    "adapter weights in this file."
                )

    specs: dict[str, tuple[int, float]] = {}
    weights: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    for module, per_layer in found.items():
        target, kind = modules[module]
        if bool(config.get("fan_in_fan_out", False)) != (kind == "T"):
            raise ConfigError(
                f"{owner}: fan_in_fan_out={config.get('fan_in_fan_out')!r} does "
                f"not apply to {module} (a "
                f"{'Conv1D' if kind == 'T' else 'Linear'} in {fam.name})."
            )
        if sorted(per_layer) != list(range(L)):
            raise ConfigError(
                f"{owner}: {module} has adapters on layers {sorted(per_layer)}, "
                f"not on all {L}; per-layer adapters are not supported."
            )
        settings = set()
        for i in range(L):
            name = fam.layer_prefix.format(i=i) + module
            if not _targeted(targets, name):
                raise ConfigError(
                    f"{owner}: {name} has adapter weights but target_modules "
                    f"{targets!r} does not name it."
                )
            settings.add(
                (
                    _pattern(rank_pattern, name, r),
                    _pattern(alpha_pattern, name, alpha),
                )
            )
        if len(settings) > 1:
            raise ConfigError(
                f"{owner}: {module} has different ranks or alphas per layer "
                f"{sorted(settings)}; not supported."
            )
        rank, a = settings.pop()
        A = np.stack([per_layer[i].get("A") for i in range(L)]).astype(np.float32)
        B = np.stack([per_layer[i].get("B") for i in range(L)]).astype(np.float32)
        weights[target] = (A, B)
        specs[target] = (int(rank), float(a))

    with_adapters = _add(model, owner, specs, use_rslora, jax.random.key(0))
    for where, node in lora_layers(with_adapters).items():
        target = next(
            t for t, tail in LORA_TARGETS.items() if where.endswith(".".join(tail))
        )
        A, B = weights[target]
        if A.shape != node.A.shape or B.shape != node.B.shape:
            raise ConfigError(
                f"{owner}: {where}: the file's A {A.shape[1:]} / B {B.shape[1:]} "
                f"do not fit the model's ({node.A.shape[1:]}, {node.B.shape[1:]} "
                "at the configured rank); an adapter for another shape?"
            )
        with_adapters = _set(with_adapters, where, node, A, B)
    return with_adapters


def _set(model: Any, where: str, node: LoRALinear, A: np.ndarray, B: np.ndarray):
    def get(m):
        for name in where.split("."):
            m = getattr(m, name)
        return m

    new = eqx.tree_at(lambda n: (n.A, n.B), node, (jnp.asarray(A), jnp.asarray(B)))
    return eqx.tree_at(get, model, new)
