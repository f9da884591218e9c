r"""Checkpoint folders as `transformers` ships them, in and out, without torch.

`load_pretrained(path)` reads a folder written by `save_pretrained` of
`transformers` (`config.json` + `model.safetensors`, or shards with
`model.safetensors.index.json`) into a `DecoderLM`; `save_pretrained(model,
path)` writes one that `transformers.AutoModelForCausalLM.from_pretrained`
loads. Both go through the one family registry (`interop.hf_common.FAMILIES`,
every module of `interop.families`), decoders and encoders alike:

- `config.json` names the family (`architectures[0]`, else `model_type`), whose
  `to_config` maps it to a `DecoderConfig` and refuses, by name, any field
  blocklab does not implement; `hf_fields` is the way back;
- the family's `Rule`s name every stored tensor and its layout (transposed,
  fused), exactly as for `from_huggingface` / `to_huggingface_state_dict`.

A new family registered with `register_family` is loaded and saved with no
change here.

Loading streams. Every header is read and checked first (keys, shapes,
dtypes: nothing is loaded from a folder that does not fit its config). Then
each stored tensor is read alone ($x$, one NumPy array, no memory map),
converted by its rule and placed: a per-layer tensor goes into its slot of
the stacked (scanned) parameter, allocated once on its devices and updated in
place (a donated `dynamic_update_slice`), so the host holds the parameters
placed so far plus one tensor. With `sharding=`, each tensor is put straight
onto the devices of its parameter's sharding.

Dtypes: each parameter keeps the dtype it is stored in (bf16 in, bf16 out)
unless `dtype=` is given, which converts every tensor as it is read.

What `transformers` does, done here too: a tied head (`tie_word_embeddings`)
is not stored, and a stored `lm_head.weight` equal to the embedding is
dropped; a stored head that differs from the embedding unties the model (with
a warning), each keeping its stored value (`transformers` 5 behaves so);
non-persistent buffers left in older files (`rotary_emb.inv_freq`, GPT-2's
`attn.bias` / `attn.masked_bias` masks) are skipped; a base-model file
without the `model.` / `transformer.` prefix is read with it. Unlike
`transformers`, an untied config whose `lm_head.weight` is missing is refused
(`transformers` would draw a random head).

What a checkpoint needs to be used besides its weights, its token ids and
`generation_config.json`, `load_pretrained` keeps in the model's config
(`DecoderConfig.bos_token_id`, ..., `generation_config`) and
`save_pretrained` writes back; `source=` (another folder), `token_ids=` and
`generation_config=` replace them, and a model built from scratch says it
has none.

Errors name the file, key or field: a bad argument is a `ConfigError`; a
folder that is not a readable checkpoint of its own config (no
`config.json`, a missing shard, a truncated file, a missing or left-over
key, a wrong shape, a stored dtype that is not floating point, a NaN or an
infinity in a weight) or that contradicts itself (a `model_type` of another
family than its `architectures`; an index beside a `model.safetensors` it
does not list, which `transformers` would read instead) is a
`CheckpointError`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import types
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._io import atomic_dir, check_folder_target, check_writable
from .._validate import ConfigError, check_bool
from ..models.decoder import DecoderLM, set_layer_data
from ..models.decoder_config import CONFIG_CLASSES, DecoderConfig
from ..training.checkpoint import CheckpointError
from ..training.plan import PRESET_CONFIGS
from .hf_common import (
    FAMILIES,
    Family,
    StoredAs,
    decoder_families,
    family_for_class,
    legacy_rope,
    rope_fields,
)
from .huggingface import (
    _all_rules,
    _base_keys,
    _complete,
    _constants,
    _exporting_family,
    _flat_families,
    _flat_family_for_class,
    _flat_skeleton,
    _is_flat_class,
    _is_flat_model,
    _skeleton,
    to_huggingface_state_dict,
)
from .porting import _converted, _float_dtype, _non_finite, _put, _walk, param_shapes
from .safetensors_io import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    Catalog,
    open_catalog,
    parse_size,
    shard_plan,
    write_shards,
)

__all__ = [
    "config_of",
    "load_pretrained",
    "pretrained_config",
    "read_config",
    "save_pretrained",
]

#: Stored tensors `transformers` itself skips when they are left over:
#: buffers older versions saved (RoPE frequencies, GPT-2's causal masks).
IGNORED_KEYS = re.compile(r"(^|\.)(rotary_emb\.inv_freq|attn\.masked_bias|attn\.bias)$")

#: Dtypes a parameter may be stored in and kept in (others need `dtype=`).
KEEP_DTYPES = ("F64", "F32", "F16", "BF16")

#: The token ids of `config.json` that a checkpoint needs to be used
#: (`generate` stops at `eos_token_id`); `save_pretrained` writes them.
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")


# config.json -----------------------------------------------------------------


def _folder(owner: str, path: Any, name: str = "path") -> Path:
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise ConfigError(
            f"{owner}: {name} must be a folder name (a non-empty str or "
            f"os.PathLike), got {path!r}."
        )
    return Path(path)


def read_config(path: str | os.PathLike) -> dict[str, Any]:
    """The `config.json` of a checkpoint folder as a dict, legacy layouts
    normalized as `transformers` does on load: a top-level `rope_theta` /
    `rope_scaling` (`type` or `rope_type`) / Gemma 3's `rope_local_base_freq`
    become `rope_parameters` (one dict, or one per layer type), Gemma 3's
    `sliding_window_pattern` becomes `layer_types`, and `torch_dtype` is read
    as `dtype`.

    Raises:
        ConfigError: `path` is not an existing folder.
        CheckpointError: the folder has no `config.json`, or it is not a JSON
            object.
    """
    owner = "load_pretrained"
    folder = _folder(owner, path)
    if not folder.is_dir():
        raise ConfigError(f"{owner}: {folder} is not a folder.")
    file = folder / CONFIG_NAME
    if not file.is_file():
        raise CheckpointError(
            f"{owner}: {folder} has no {CONFIG_NAME}; a checkpoint folder (as "
            "transformers' save_pretrained writes it) holds config.json and "
            "model.safetensors (or shards with model.safetensors.index.json)."
        )
    return _standardize(_json_object(owner, file, error=CheckpointError))


def _standardize(raw: dict[str, Any]) -> dict[str, Any]:
    out = dict(raw)
    if "torch_dtype" in out:
        dtype = out.pop("torch_dtype")
        out.setdefault("dtype", dtype)
    legacy = [
        k for k in ("rope_theta", "rope_scaling", "rope_local_base_freq") if k in out
    ]
    if out.get("rope_parameters") is None and legacy:
        theta = out.pop("rope_theta", None)
        scaling = out.pop("rope_scaling", None)
        local = out.pop("rope_local_base_freq", None)
        flat = legacy_rope(scaling, theta, 10000.0)
        if local is not None:
            out["rope_parameters"] = {
                "full_attention": flat,
                "sliding_attention": rope_fields(local),
            }
        else:
            out["rope_parameters"] = flat
    elif isinstance(out.get("rope_parameters"), Mapping) and "rope_theta" in out:
        params = dict(out["rope_parameters"])
        if "rope_type" in params or "type" in params:  # flat: the base goes inside
            params.setdefault("rope_theta", out.pop("rope_theta"))
            out["rope_parameters"] = params
    pattern = out.get("sliding_window_pattern")
    if out.get("layer_types") is None and isinstance(pattern, int) and pattern > 0:
        n = out.get("num_hidden_layers")
        if isinstance(n, int):
            out["layer_types"] = [
                "sliding_attention" if (i + 1) % pattern else "full_attention"
                for i in range(n)
            ]
            out.pop("sliding_window_pattern")
    return out


def _family_of(raw: Mapping[str, Any], where: Path) -> Family:
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    families = decoder_families()
    typed = [
        f
        for f in families.values()
        if model_type is not None and model_type in f.model_types
    ]
    if archs:
        if isinstance(archs, str) or not isinstance(archs, list):
            raise CheckpointError(
                f"load_pretrained: {where}: architectures must be a list of class "
                f"names, got {archs!r}."
            )
        named: dict[str, Family] = {}  # family name -> family, in order
        for name in archs:
            if any(name in f.classes for f in families.values()):
                fam = family_for_class(name)
                named.setdefault(fam.name, fam)
        if not named:
            supported = sorted(c for f in families.values() for c in f.classes)
            raise ConfigError(
                f"load_pretrained: {where}: architectures={archs!r} names no "
                f"supported model class; supported: {supported} (register others "
                "with blocklab.interop.register_family)."
            )
        fams = list(named.values())
        # transformers builds the config class of model_type and the model of
        # that class: a model_type of another family is another model.
        if len(fams) > 1 or (typed and typed[0] is not fams[0]):
            said = f"architectures={archs!r}"
            if typed:
                said += f" and model_type={model_type!r}"
            names = sorted({f.name for f in fams} | {f.name for f in typed})
            raise CheckpointError(
                f"load_pretrained: {where}: {said} name different model families "
                f"({', '.join(names)}); transformers builds the model of "
                "model_type, so the folder does not say which model it holds. Make "
                "them agree (e.g. model_type="
                f"{fams[0].model_types[0]!r} for {fams[0].classes[0]})."
            )
        return fams[0]
    if typed:
        return typed[0]
    types_ = sorted(t for f in families.values() for t in f.model_types)
    raise ConfigError(
        f"load_pretrained: {where}: no architectures entry, and model_type="
        f"{model_type!r} is not one of {types_}."
    )


def pretrained_config(path: str | os.PathLike) -> DecoderConfig:
    """The `DecoderConfig` of a checkpoint folder's `config.json` (no weight
    is read): what `load_pretrained` builds, e.g. for diagnostics of the
    architecture at initialization (`blocklab signal --pretrained PATH`).

    Raises:
        ConfigError: an unknown `architectures` class, or a config field
            blocklab does not implement (named with its value).
        CheckpointError: no `config.json`, or a missing field (named).
    """
    folder = _folder("load_pretrained", path)
    return _config(read_config(folder), folder / CONFIG_NAME)[1]


def _config(raw: dict[str, Any], where: Path) -> tuple[Family, DecoderConfig]:
    fam = _family_of(raw, where)
    try:
        cfg = fam.to_config(types.SimpleNamespace(**raw))
    except AttributeError as err:
        name = getattr(err, "name", None) or str(err)
        raise CheckpointError(
            f"load_pretrained: {where} has no field {name!r}, which the "
            f"{fam.classes[0]} config needs."
        ) from None
    except ConfigError as err:
        raise ConfigError(f"load_pretrained: {where}: {err}") from None
    return fam, cfg


# config_of -----------------------------------------------------------------------


#: What `config_of` takes, for its errors.
_CONFIG_KINDS = (
    "a preset {presets}, a checkpoint folder (config.json + weights, as "
    "transformers' save_pretrained writes it), a transformers config.json, or a "
    "JSON file of DecoderConfig fields"
)


def config_of(
    spec: str | os.PathLike | DecoderConfig, *, name: str = "config"
) -> DecoderConfig:
    """The `DecoderConfig` of a preset name, a checkpoint folder, a
    `transformers` `config.json`, a JSON file of `DecoderConfig` fields (or
    `DecoderLM.init_args()`'s output), or a config (returned as is).

    A folder or a `transformers` config is mapped as `load_pretrained` maps
    it (`blocklab.interop.pretrained_config`): the family from
    `architectures` (else `model_type`), every field blocklab does not
    implement refused by name. No weight is read.

    Args:
        spec: the config.
        name: the argument's name in the errors (`"--config"` for the CLI).

    Raises:
        ConfigError: none of these, naming `name`, the value and what is
            valid; or the config's own refusal (an unknown class, an
            unsupported field), naming the file.
    """
    if isinstance(spec, DecoderConfig):
        return spec
    if isinstance(spec, str) and spec in PRESET_CONFIGS:
        return PRESET_CONFIGS[spec]()
    kinds = _CONFIG_KINDS.format(presets=sorted(PRESET_CONFIGS))
    if not isinstance(spec, (str, os.PathLike)) or not str(spec):
        raise ConfigError(f"config_of: {name} must be {kinds}; got {spec!r}.")
    path = Path(spec)
    if path.is_dir():
        try:
            return pretrained_config(path)
        except (ConfigError, CheckpointError) as err:
            raise ConfigError(f"config_of: {name}={str(spec)!r}: {err}") from None
    if not path.is_file():
        raise ConfigError(
            f"config_of: {name} must be {kinds}; got {str(spec)!r}, which is none of "
            "these (no such preset, file or folder)."
        )
    try:
        fields = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ConfigError(
            f"config_of: {name}={str(spec)!r} is not readable JSON ({err}); it must be "
            f"{kinds}."
        ) from None
    if not isinstance(fields, dict):
        raise ConfigError(
            f"config_of: {name}={str(spec)!r} must hold a JSON object, got "
            f"{type(fields).__name__}; it must be {kinds}."
        )
    if "architectures" in fields or "model_type" in fields:
        return _from_transformers(fields, path, name)
    cfg_class = "DecoderConfig"
    if isinstance(fields.get("cfg"), dict):  # DecoderLM.init_args() output
        cfg_class = fields.get("cfg_class", cfg_class)
        fields = fields["cfg"]
    if cfg_class not in CONFIG_CLASSES:
        raise ConfigError(
            f"config_of: {name}={str(spec)!r}: cfg_class must be one of "
            f"{sorted(CONFIG_CLASSES)}, got {cfg_class!r}."
        )
    try:
        return CONFIG_CLASSES[cfg_class](**fields)
    except TypeError as err:  # ConfigError included: a field's own refusal
        raise ConfigError(
            f"config_of: {name}={str(spec)!r} is not a {cfg_class} (a JSON object of "
            f"its fields, or a transformers config.json with 'architectures'): "
            f"{err}"
        ) from None


def _from_transformers(raw: dict, path: Path, name: str) -> DecoderConfig:
    """A `transformers` config read as `load_pretrained` reads a folder's."""
    try:
        return _config(_standardize(raw), path)[1]
    except (ConfigError, CheckpointError) as err:
        raise ConfigError(f"config_of: {name}={str(path)!r}: {err}") from None


# load_pretrained -----------------------------------------------------------------


def _resolve_sharding(sharding: Any) -> Callable[[str], Any]:
    if sharding is None:
        return lambda path: None
    if isinstance(sharding, jax.sharding.Sharding):
        return lambda path: sharding
    if callable(sharding):

        def of(path: str):
            out = sharding(path)
            if out is not None and not isinstance(out, jax.sharding.Sharding):
                raise ConfigError(
                    f"load_pretrained: sharding({path!r}) must return a "
                    f"jax.sharding.Sharding or None, got {type(out).__name__}."
                )
            return out

        return of
    raise ConfigError(
        "load_pretrained: sharding must be None, a jax.sharding.Sharding or a "
        "function of the parameter's path (e.g. 'stack.blocks.attention.W_q.weight')"
        f" returning one, got {type(sharding).__name__}."
    )


def _slice_sharding(sharding: Any):
    """The sharding of one layer of a stacked parameter sharded by `sharding`."""
    if sharding is None:
        return None
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec)[1:]
        return jax.sharding.NamedSharding(
            sharding.mesh, jax.sharding.PartitionSpec(*spec)
        )
    if isinstance(sharding, jax.sharding.SingleDeviceSharding):
        return sharding
    return None  # let the update place it


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stacked: jax.Array, layer: jax.Array, i: jax.Array) -> jax.Array:
    return jax.lax.dynamic_update_index_in_dim(
        stacked, layer.astype(stacked.dtype), i, 0
    )


@dataclasses.dataclass
class _Slot:
    """One parameter of the model: its path, shape, dtype, sharding, value."""

    path: str
    shape: tuple[int, ...]
    num_layers: int | None  # stacked: the layer count; else None
    dtype: np.dtype | None = None
    sharding: Any = None
    value: Any = None
    filled: int = 0


def load_pretrained(
    path: str | os.PathLike,
    *,
    dtype: Any = None,
    sharding: Any = None,
    model_class: str | None = None,
) -> Any:
    r"""The `DecoderLM` of a checkpoint folder written by `transformers`.

    The folder holds `config.json` and `model.safetensors`, or shards listed
    by `model.safetensors.index.json`. The result's logits are those of
    `from_huggingface` of the `transformers` model the folder loads into (the
    same weights, the same config mapping). torch is never imported.

    Memory: each tensor is read, converted and placed alone, so the peak host
    memory is about the parameters' bytes plus the largest stored tensor (see
    `benchmarks/load_pretrained.py`).

    Args:
        path: the folder.
        dtype: convert every parameter to this floating dtype as it is read;
            `None` keeps the stored dtypes (bf16 in, bf16 parameters out).
        sharding: where the parameters go: `None` (the default device), a
            `jax.sharding.Sharding` for every parameter, or a function of a
            parameter's path (its dotted name in the model, e.g.
            `"token_emb.weight"`, `"stack.blocks.attention.W_q.weight"` for
            the stacked per-layer array with the layer axis first) returning
            a `Sharding` or `None`. Each tensor goes straight onto its devices.
        model_class: encoder families only: read the folder as this
            `transformers` class of its family (default: its
            `architectures`), e.g. `"BertModel"` for the encoder of a
            `BertForMaskedLM` folder, its head left out (see
            `_load_flat_pretrained`); a tensor the class
            has and the folder lacks is refused by name.

    Returns:
        A `DecoderLM` (a `MoEDecoderConfig` model for Mixtral); for the
        encoder families (BERT, ModernBERT, ViT, T5, Whisper) an
        `EncoderModel` or `EncoderDecoderLM` (for a base class such as
        `BertModel`, one without heads: `model(ids)` is the last hidden
        state, `model.pooler_output(h)` the pooled output).

    Raises:
        ConfigError: a bad argument, an unknown `architectures` class, a
            config field blocklab does not implement (named with its value),
            or a weight that overflows `dtype`.
        CheckpointError: no `config.json`, a shard missing or truncated, a
            key missing or left over, a tensor of the wrong shape or of a
            dtype that is not floating point, a weight holding NaN or an
            infinity (as `load_state_dict` refuses it), a `model_type` and
            `architectures` of different families, or an index beside a
            `model.safetensors` it does not list (each named with its file).
    """
    owner = "load_pretrained"
    folder = _folder(owner, path)
    target_dtype = _float_dtype(owner, dtype, "the stored dtypes")
    sharding_of = _resolve_sharding(sharding)
    raw = read_config(folder)
    encoder = _flat_family_of_config(raw)
    if encoder is not None:  # a family of the all-at-once layout: the encoders
        return _load_flat_pretrained(
            folder, raw, *encoder, dtype=target_dtype, sharding_of=sharding_of,
            model_class=model_class,
        )  # fmt: skip
    if model_class is not None:
        raise ConfigError(
            f"{owner}: model_class= is for the encoder families' folders "
            f"({[n for n, f in FAMILIES.items() if not f.layered]}); {folder} "
            "holds a decoder."
        )
    fam, cfg = _config(raw, folder / CONFIG_NAME)
    cfg = _with_usage(owner, cfg, raw, folder)
    with open_catalog(folder) as catalog:
        cfg, stored_of = _match(cfg, fam, catalog, folder)
        return _assemble(cfg, fam, catalog, stored_of, target_dtype, sharding_of)


def _part_shapes(stored: StoredAs, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The stored shapes of a state-dict tensor of `shape` (no allocation)."""
    ghost = np.broadcast_to(np.zeros((), np.float32), shape)
    return [tuple(a.shape) for a in stored.split(ghost)]


def _match(
    cfg: DecoderConfig, fam: Family, catalog: Catalog, folder: Path
) -> tuple[DecoderConfig, dict[str, tuple[str, ...] | str]]:
    """Check the stored keys and shapes against the config (before any data is
    read); returns the config (untied when the file unties it) and, per
    state-dict key, its stored key or (another layout) its stored keys."""
    owner = "load_pretrained"
    rules = _all_rules(cfg, fam)
    stored = set(catalog.keys())
    embed_key = rules[0][0]
    prefix = embed_key.split(".", 1)[0] + "."
    if cfg.tie_embeddings and "lm_head.weight" in stored:
        emb_key = _stored(embed_key, stored, prefix)
        head = catalog.read("lm_head.weight")
        emb = catalog.read(emb_key) if emb_key is not None else None
        if emb is not None and head.shape == emb.shape and np.array_equal(head, emb):
            stored.discard("lm_head.weight")
        else:
            warnings.warn(
                f"load_pretrained: {folder}: config.json ties the head to the "
                "embedding (tie_word_embeddings=true) but lm_head.weight differs "
                f"from {embed_key}; untying them, each keeps its stored value (as "
                "transformers does).",
                stacklevel=3,
            )
            cfg = dataclasses.replace(cfg, tie_embeddings=False)
            rules = _all_rules(cfg, fam)
        del head, emb
    layouts = dict(fam.stored_as(cfg)) if fam.stored_as is not None else {}
    sources: dict[str, tuple[str, ...] | str] = {}
    missing = []
    for hf, _ in rules:
        key = _stored(hf, stored, prefix)
        if key is not None:
            sources[hf] = key
            continue
        layout = layouts.get(hf)
        if layout is None:
            missing.append(hf)
            continue
        parts = [_stored(k, stored, prefix) for k in layout.keys]
        if all(k is not None for k in parts):
            sources[hf] = tuple(parts)
        elif any(k is not None for k in parts):
            missing.extend(
                k for k, got in zip(layout.keys, parts, strict=True) if got is None
            )
        else:
            missing.append(hf)
    used = {k for v in sources.values() for k in ((v,) if isinstance(v, str) else v)}
    leftover = sorted(k for k in stored - used if not IGNORED_KEYS.search(k))
    if missing or leftover:
        problems = []
        if missing:
            problems.append(f"missing keys {missing}")
            if "lm_head.weight" in missing:
                problems.append(
                    "(config.json unties the head, tie_word_embeddings=false, but no "
                    "lm_head.weight is stored; transformers would draw a random head)"
                )
        if leftover:
            problems.append(f"left-over keys {leftover}")
        raise CheckpointError(
            f"{owner}: {folder}: the stored tensors do not match the "
            f"{fam.classes[0]} of its config.json: {'; '.join(problems)}."
        )
    skeleton = _skeleton(cfg)
    shapes = param_shapes(skeleton)
    for hf, rule in rules:
        want = tuple(rule.hf_shape([shapes[b] for b in rule.bl]))
        source = sources[hf]
        if isinstance(source, str):
            checks = [(source, want)]
        else:
            checks = list(zip(source, _part_shapes(layouts[hf], want), strict=True))
        for key, shape in checks:
            info = catalog.infos[key]
            if info.shape != shape:
                raise CheckpointError(
                    f"{owner}: {info.file}: tensor {key!r} has shape {info.shape}; "
                    f"the config.json model expects {shape}."
                )
            info.check_float(owner, key)
    return cfg, sources


def _stored(hf: str, stored: set[str], prefix: str) -> str | None:
    """The stored key of the expected key `hf` (a base-model file lacks the
    `model.` / `transformer.` prefix)."""
    if hf in stored:
        return hf
    if hf.startswith(prefix) and hf[len(prefix) :] in stored:
        return hf[len(prefix) :]
    return None


def _leaf_path(names) -> str:
    if isinstance(names, str):
        return names
    rest = names[0][len(names.head) :].split(".", 1)[1]
    return names.head + rest


def _assemble(
    cfg: DecoderConfig,
    fam: Family,
    catalog: Catalog,
    stored_of: dict[str, str],
    target_dtype: np.dtype | None,
    sharding_of: Callable[[str], Any],
) -> DecoderLM:
    owner = "load_pretrained"
    skeleton = _skeleton(cfg)
    skeleton = eqx.tree_at(
        lambda m: m.stack, skeleton, set_layer_data(skeleton.stack, cfg)
    )
    rules = _all_rules(cfg, fam)
    # Every parameter name -> (its slot, layer index or None).
    where: dict[str, tuple[_Slot, int | None]] = {}
    slots: dict[str, _Slot] = {}

    def register(names, leaf):
        path = _leaf_path(names)
        if isinstance(names, str):
            slot = _Slot(path, tuple(leaf.shape), None)
            where[names] = (slot, None)
        else:
            slot = _Slot(path, tuple(leaf.shape), len(names))
            where.update((n, (slot, i)) for i, n in enumerate(names))
        slots[path] = slot
        return leaf

    _walk(skeleton, register)
    covered = {b for _, r in rules for b in r.bl}
    uncovered = sorted(set(where) - covered)
    if uncovered:  # a family whose rules miss a parameter: a bug, not the file
        raise ConfigError(
            f"{owner}: the {fam.name} family's rules do not cover the parameters "
            f"{uncovered[:5]}."
        )
    # Each parameter's dtype: the requested one, else the (promoted) stored one.
    layouts = dict(fam.stored_as(cfg)) if fam.stored_as is not None else {}
    for hf, rule in rules:
        source = stored_of[hf]
        for key in (source,) if isinstance(source, str) else source:
            info = catalog.infos[key]
            for b in rule.bl:
                slot, _ = where[b]
                if target_dtype is not None:
                    slot.dtype = target_dtype
                elif info.dtype not in KEEP_DTYPES:
                    raise CheckpointError(
                        f"{owner}: {info.file}: tensor {key!r} is stored as "
                        f"{info.dtype}; pass dtype= (e.g. jnp.bfloat16) to convert it."
                    )
                else:
                    dt = np.dtype(info.np_dtype)
                    slot.dtype = (
                        dt
                        if slot.dtype is None
                        else np.dtype(jnp.promote_types(slot.dtype, dt))
                    )
    for slot in slots.values():
        slot.sharding = sharding_of(slot.path)
    for hf, rule in rules:
        source = stored_of[hf]
        if isinstance(source, str):
            array = _read_finite(catalog, source)
        else:
            array = layouts[hf].join([_read_finite(catalog, k) for k in source])
        for b, piece in zip(rule.bl, rule.from_hf(array), strict=True):
            slot, layer = where[b]
            _place(slot, layer, _converted(piece, slot.dtype, hf))
        del array
    values = {path: slot.value for path, slot in slots.items()}

    def take(names, leaf):
        return values[_leaf_path(names)]

    return _walk(skeleton, take)


def _read_finite(catalog: Catalog, key: str) -> np.ndarray:
    """The stored tensor `key`, refused if it holds NaN or infinities (the rule
    of `load_state_dict`)."""
    array = catalog.read(key)
    bad = _non_finite(array)
    if bad is not None:
        raise CheckpointError(
            f"load_pretrained: {catalog.infos[key].file}: tensor {key!r} {bad}."
        )
    return array


def _place(slot: _Slot, layer: int | None, piece: np.ndarray) -> None:
    """Put one converted tensor into its parameter (its layer's slot)."""
    # Each placement is waited for: with asynchronous dispatch the loop would
    # run ahead and keep many host tensors alive at once.
    if layer is None:
        slot.value = _put(piece, slot.sharding).block_until_ready()
        return
    shape = (slot.num_layers, *slot.shape[1:])
    if slot.value is None:  # zeros from calloc'd host pages: nothing compiled
        slot.value = _put(np.zeros(shape, slot.dtype), slot.sharding)
    part = _slice_sharding(slot.sharding)
    dev_piece = _put(piece, part)
    del piece
    slot.value = _put_layer(slot.value, dev_piece, np.int32(layer)).block_until_ready()
    slot.filled += 1


# save_pretrained -----------------------------------------------------------------


def _json_value(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_json_value(v) for v in x]
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def _dtype_name(model: DecoderLM) -> str:
    """The dtype most parameter bytes are in (what `transformers` loads with)."""
    bytes_by: dict[str, int] = {}
    for leaf in jax.tree_util.tree_leaves(eqx.filter(model, eqx.is_inexact_array)):
        name = jnp.dtype(leaf.dtype).name
        bytes_by[name] = bytes_by.get(name, 0) + leaf.size * leaf.dtype.itemsize
    return max(bytes_by, key=bytes_by.get) if bytes_by else "float32"


def hf_config_dict(
    model: DecoderLM, fam: Family, token_ids: Mapping[str, Any]
) -> dict[str, Any]:
    """The `config.json` of `model` for `fam`: the family's fields plus
    `architectures`, `model_type`, `dtype` and `token_ids`."""
    fields = dict(fam.hf_fields(model.cfg))
    fields.update(token_ids)
    fields.update(
        architectures=[fam.classes[0]],
        model_type=fam.model_types[0],
        dtype=_dtype_name(model),
    )
    return {k: _json_value(v) for k, v in sorted(fields.items())}


def _token_id(owner: str, where: str, name: str, value: Any, vocab: int) -> Any:
    """`value` as the token id `name` of a model with `vocab` tokens: `None`,
    an int in [0, vocab), or (`eos_token_id` only) a non-empty list of them."""

    def one(v):
        if (
            isinstance(v, (int, np.integer))
            and not isinstance(v, (bool, np.bool_))
            and 0 <= v < vocab
        ):
            return int(v)
        lists = ", or a non-empty list of such ints" if name == "eos_token_id" else ""
        raise ConfigError(
            f"{owner}: {where}={value!r} is not a token id of this model: None, "
            f"an int in [0, {vocab}){lists}."
        )

    if value is None:
        return None
    if name == "eos_token_id" and isinstance(value, (list, tuple)) and value:
        return [one(v) for v in value]
    return one(value)


def _json_object(
    owner: str, file: Path, name: str | None = None, error: type = ConfigError
) -> dict[str, Any]:
    """The JSON object in `file`, or `error` naming `owner` (and `name`)."""
    where = f"{owner}: {name}: " if name is not None else f"{owner}: "
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as err:
        raise error(f"{where}{file} is not JSON: {err}") from None
    if not isinstance(raw, dict):
        raise error(f"{where}{file} is not a JSON object.")
    return raw


def _with_usage(
    owner: str, cfg: DecoderConfig, raw: Mapping[str, Any], folder: Path
) -> DecoderConfig:
    """`cfg` with the folder's token ids (`config.json`) and its
    `generation_config.json`, kept in the config for `save_pretrained`."""
    vocab = cfg.vocab_size
    ids = {
        k: _token_id(owner, f"{folder / CONFIG_NAME}: {k}", k, raw[k], vocab)
        for k in TOKEN_IDS
        if k in raw
    }
    if isinstance(ids.get("eos_token_id"), list):
        ids["eos_token_id"] = tuple(ids["eos_token_id"])
    file = folder / GENERATION_CONFIG_NAME
    if file.is_file():
        ids["generation_config"] = json.dumps(
            _json_object(owner, file, "generation config"), sort_keys=True
        )
    return dataclasses.replace(cfg, **ids) if ids else cfg


def _usage(
    owner: str,
    vocab: int,
    source: Any,
    token_ids: Any,
    generation_config: Any,
    cfg: Any = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The token ids of `config.json` and the generation config that
    `save_pretrained` writes (see its docstring for the rule)."""
    ids: dict[str, Any] = dict.fromkeys(TOKEN_IDS)  # built from scratch: none
    generation = None
    if source is None and cfg is not None:  # what the model's config keeps
        kept = {k: getattr(cfg, k, None) for k in TOKEN_IDS}
        text = getattr(cfg, "generation_config", None)
        if text is not None or any(v is not None for v in kept.values()):
            ids = {k: list(v) if isinstance(v, tuple) else v for k, v in kept.items()}
            generation = None if text is None else json.loads(text)
    if source is not None:
        folder = _folder(owner, source, "source")
        file = folder / CONFIG_NAME
        if not file.is_file():
            raise ConfigError(
                f"{owner}: source={str(source)!r} is not a checkpoint folder (it "
                f"has no {CONFIG_NAME}); pass the folder the model was loaded from."
            )
        raw = _json_object(owner, file, "source")
        ids = {
            k: _token_id(owner, f"source {file}: {k}", k, raw[k], vocab)
            for k in TOKEN_IDS
            if k in raw  # a missing id keeps transformers' default for the class
        }
        if (folder / GENERATION_CONFIG_NAME).is_file():
            generation = _json_object(owner, folder / GENERATION_CONFIG_NAME, "source")
    given: dict[str, Any] = {}
    if token_ids is not None:
        if not isinstance(token_ids, Mapping):
            raise ConfigError(
                f"{owner}: token_ids must be a dict of {list(TOKEN_IDS)}, got "
                f"{type(token_ids).__name__} {token_ids!r}."
            )
        unknown = sorted(str(k) for k in token_ids if k not in TOKEN_IDS)
        if unknown:
            raise ConfigError(
                f"{owner}: token_ids has the keys {unknown}; the valid keys are "
                f"{list(TOKEN_IDS)}."
            )
        given = {
            k: _token_id(owner, f"token_ids[{k!r}]", k, v, vocab)
            for k, v in token_ids.items()
        }
        ids.update(given)
    if generation_config is not None:
        if not isinstance(generation_config, Mapping):
            raise ConfigError(
                f"{owner}: generation_config must be a dict (the content of "
                f"{GENERATION_CONFIG_NAME}; for a transformers GenerationConfig, "
                f"its .to_dict()), got {type(generation_config).__name__}."
            )
        generation = {str(k): v for k, v in generation_config.items()}
    if generation is None:  # as transformers derives it from config.json
        generation = {"_from_model_config": True}
        generation.update((k, v) for k, v in ids.items() if v is not None)
    else:
        generation.update(given)
    for k in TOKEN_IDS:
        if k in generation:
            generation[k] = _token_id(
                owner, f"generation config {k}", k, generation[k], vocab
            )
    try:
        json.dumps(generation, allow_nan=False)
    except (TypeError, ValueError) as err:
        raise ConfigError(
            f"{owner}: the generation config cannot be written as JSON ({err})."
        ) from None
    return ids, generation


def save_pretrained(
    model: Any,
    path: str | os.PathLike,
    *,
    max_shard_size: Any = "5GB",
    overwrite: Any = False,
    family: str | None = None,
    source: str | os.PathLike | None = None,
    token_ids: Mapping[str, Any] | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    r"""Write `model` as a checkpoint folder that `transformers` loads.

    The folder holds `config.json` (the family's config fields with
    `architectures`, `model_type`, `dtype` and the token ids),
    `generation_config.json`, and the weights in the family's names and
    layouts (`model.safetensors`, metadata `{"format": "pt"}`), split into
    `model-0000i-of-0000N.safetensors` with `model.safetensors.index.json`
    when they pass `max_shard_size`.
    `transformers.AutoModelForCausalLM.from_pretrained(path)` then computes
    the model's logits, and `load_pretrained(path)` returns the model bit for
    bit (each parameter in its dtype). A tied head is stored once, as the
    embedding (no `lm_head.weight`), as `transformers` stores it.

    Token ids and generation config. They come from the model's config
    (`model.cfg.bos_token_id`, `eos_token_id`, `pad_token_id` and
    `generation_config`, which `load_pretrained` fills from the folder: a
    model loaded, fine-tuned and saved keeps them, and `generate` in
    `transformers` stops where the original did), or, when given, from a
    folder `source=` (its `config.json`'s ids and its
    `generation_config.json`, written as they are) instead, and from
    `token_ids=` / `generation_config=`, which replace them. Without any,
    the model is taken as built from scratch and says it has none: the three ids are
    written as `null` (not the class defaults `transformers` would fill in,
    e.g. GPT-2's 50256, which may not even be in the vocabulary), and
    `generate` runs to its length limit. With no generation config given or
    in `source`, it is derived from the ids (`"_from_model_config": true`),
    as `transformers` does.

    The folder is written beside `path` and renamed into place when complete:
    a failure leaves nothing half-written, and an earlier folder at `path` as
    it was. One shard's tensors are in host memory at a time.

    Args:
        model: a `DecoderLM`.
        path: the folder; it must not exist, or be empty, unless `overwrite`.
        max_shard_size: bytes per shard, an int or a string (`"5GB"` is
            5e9 bytes, `"500MiB"` 500 * 2**20).
        overwrite: replace a non-empty folder at `path`.
        family: a family's short name or class name; `None`: the family that
            can express the model (`resolve_family`).
        source: the checkpoint folder the model was loaded from (e.g. the
            path given to `load_pretrained`): its token ids and generation
            config are written (an id its `config.json` leaves out stays out,
            so `transformers` fills in its class default, as it did there).
        token_ids: `{"bos_token_id": ..., "eos_token_id": ...,
            "pad_token_id": ...}` (any of them): each an id in
            `[0, vocab_size)` or `None` (none); `eos_token_id` may be a list
            (several end tokens). They replace those of `source`, in
            `config.json` and in the generation config.
        generation_config: the content of `generation_config.json` (a dict;
            a `transformers` `GenerationConfig`'s `.to_dict()`), replacing
            that of `source`.

    Returns:
        The folder's path. A symlink `path` stays a link: the folder it
        points to is replaced (with `overwrite=True`).

    Raises:
        ConfigError: `model` is not a `DecoderLM`, no (or an ambiguous)
            family can express it (each setting named), a bad
            `max_shard_size`, `path` is a file or a non-empty folder
            without `overwrite=True`, `source` is not a checkpoint folder,
            or a token id (given, or carried from `source`) that is not one
            of this model's (named with its value and the valid range).
        OSError: the folder of `path` cannot be written (named, with the
            reason; nothing is left behind).
    """
    owner = "save_pretrained"
    if _is_flat_model(model) and source is not None:
        raise ConfigError(
            f"{owner}: source= is not implemented for the encoder families; "
            "pass token_ids= and generation_config= instead."
        )
    if not _is_flat_model(model) and not isinstance(model, DecoderLM):
        raise ConfigError(
            f"{owner}: model must be a DecoderLM, got {type(model).__name__}."
        )
    folder = _folder(owner, path)
    max_bytes = parse_size(owner, max_shard_size)
    overwrite = check_bool(owner, "overwrite", overwrite)
    check_folder_target(folder, owner=owner, overwrite=overwrite)
    check_writable(folder / CONFIG_NAME, owner=owner, name="path")
    fam = _exporting_family(owner, model, family)
    if not fam.layered:  # every tensor at once: no per-layer streaming
        return _save_flat_pretrained(
            model, folder, fam, max_bytes=max_bytes, overwrite=overwrite,
            token_ids=token_ids, generation_config=generation_config,
        )  # fmt: skip
    ids, generation = _usage(
        owner, model.cfg.vocab_size, source, token_ids, generation_config, model.cfg
    )
    rules = dict(_all_rules(model.cfg, fam))
    arrays: dict[str, Callable[[], np.ndarray]] = {}

    def record(names, leaf):
        if isinstance(names, str):
            arrays[names] = lambda: np.asarray(leaf)
        else:
            for i, n in enumerate(names):
                arrays[n] = functools.partial(lambda j: np.asarray(leaf[j]), i)
        return leaf

    _walk(model, record)
    shapes = param_shapes(model)
    dtypes = {}

    def dtype_of(names, leaf):
        for n in [names] if isinstance(names, str) else names:
            dtypes[n] = np.dtype(leaf.dtype)
        return leaf

    _walk(model, dtype_of)
    layouts = dict(fam.stored_as(model.cfg)) if fam.stored_as is not None else {}
    sizes, num_params, part_of = [], 0, {}
    for hf, rule in rules.items():
        shape = rule.hf_shape([shapes[b] for b in rule.bl])
        num_params += math.prod(shape)
        dt = np.dtype(functools.reduce(jnp.promote_types, [dtypes[b] for b in rule.bl]))
        if hf in layouts:  # stored in the file's own layout (as transformers does)
            parts = _part_shapes(layouts[hf], shape)
            for j, (key, part) in enumerate(zip(layouts[hf].keys, parts, strict=True)):
                sizes.append((key, math.prod(part) * dt.itemsize))
                part_of[key] = (hf, j)
        else:
            sizes.append((hf, math.prod(shape) * dt.itemsize))
    shards = shard_plan(sizes, max_bytes)
    last: dict[str, list[np.ndarray]] = {}

    def state_tensor(hf: str) -> np.ndarray:
        rule = rules[hf]
        return rule.to_hf([arrays[b]() for b in rule.bl])

    def tensor(key: str) -> np.ndarray:
        if key not in part_of:
            return state_tensor(key)
        hf, j = part_of[key]
        if hf not in last:  # the parts of one tensor are consecutive: keep one
            last.clear()
            last[hf] = layouts[hf].split(state_tensor(hf))
        return last[hf][j]

    config = hf_config_dict(model, fam, ids)
    with atomic_dir(folder, owner=owner, overwrite=overwrite) as tmp:
        for _ in write_shards(tmp, shards, tensor, num_params=num_params):
            pass
        for name, content in (
            (CONFIG_NAME, config),
            (GENERATION_CONFIG_NAME, generation),
        ):
            (tmp / name).write_text(
                json.dumps(content, indent=2, sort_keys=True) + "\n"
            )
    return folder


# The all-at-once layout (Family.rules: the encoders) ----------------------------


def _flat_family_of_config(
    raw: Mapping[str, Any],
) -> tuple[Family, str] | None:
    """The encoder family and model class of a `config.json` (its
    `architectures[0]`, else its `model_type`'s first class), or `None`."""
    archs = raw.get("architectures")
    if isinstance(archs, list):
        for name in archs:
            if isinstance(name, str) and _is_flat_class(name):
                fam = _flat_family_for_class(name)
                model_type = raw.get("model_type")
                if model_type is not None and model_type not in fam.model_types:
                    raise CheckpointError(
                        f"load_pretrained: config.json names architectures="
                        f"{archs!r} but model_type={model_type!r}; transformers "
                        f"builds the model of model_type (the {fam.name} family's "
                        f"are {list(fam.model_types)})."
                    )
                return fam, name
        return None
    model_type = raw.get("model_type")
    for fam in _flat_families():
        if model_type in fam.model_types:
            return fam, fam.classes[0]
    return None


def _placed(
    skeleton: Any,
    ours: Mapping[str, np.ndarray],
    dtype: Any,
    sharding_of: Callable[[str], Any],
) -> Any:
    """`skeleton` with every parameter from `ours` (`{state-dict name: array}`),
    in `dtype` (`None`: the skeleton's), each put straight onto the devices of
    `sharding_of(path)` (`None`: the default device)."""

    def take(names, leaf):
        path = _leaf_path(names)
        if isinstance(names, str):
            array = np.asarray(ours[names])
        else:
            array = np.stack([np.asarray(ours[n]) for n in names])
        target = np.dtype(leaf.dtype if dtype is None else dtype)
        array = _converted(array, target, path, what="parameter", hint="")
        return _put(array, sharding_of(path))

    return _walk(skeleton, take)


def _sources(expected: Any, stored: set[str], prefix: str) -> dict[str, str]:
    """`{expected key: its stored key}`: the key itself, else the key with the
    base model's `prefix` removed or added (a base folder read into a head
    class, a head folder read into the base class)."""
    out = {}
    for key in expected:
        if key in stored:
            out[key] = key
        elif prefix and key.startswith(prefix) and key[len(prefix) :] in stored:
            out[key] = key[len(prefix) :]
        elif prefix and not key.startswith(prefix) and prefix + key in stored:
            out[key] = prefix + key
    return out


def _load_flat_pretrained(
    folder: Path,
    raw: Mapping[str, Any],
    fam: Family,
    cls: str,
    *,
    dtype=None,
    sharding_of: Callable[[str], Any] | None = None,
    model_class: str | None = None,
) -> Any:
    """The model of a checkpoint folder of an encoder family (`raw`: its
    `config.json`, `cls` the class it names). Keys and shapes are checked
    before any tensor is read; each parameter goes straight onto the devices
    of `sharding_of(path)` (as `load_pretrained`'s `sharding=`).

    `model_class`, another class of the family, reads the folder as
    `transformers`' `model_class.from_pretrained` does where that is exact:
    the tensors it has must all be stored (with or without the base
    model's prefix); stored tensors it lacks (the folder's heads) are left
    out. A tensor it has that the folder lacks is refused by name, where
    `transformers` would draw it at random; a base model's pooler is then
    left out instead (`BertModel`, `ViTModel`: the pooler is there iff its
    tensors are stored).

    Raises:
        ConfigError: a config field blocklab does not implement (named), a
            `model_class` of another family.
        CheckpointError: a missing or left-over key, a wrong shape, a
            non-floating dtype, a NaN or infinity (named with its file).
    """
    import types

    owner = "load_pretrained"
    where = folder / CONFIG_NAME
    stored_cls = cls
    if model_class is not None:
        if model_class not in fam.classes:
            raise ConfigError(
                f"{owner}: model_class={model_class!r} is not a class of the "
                f"{fam.name} family of {where} (architectures {stored_cls}); its "
                f"classes are {list(fam.classes)}."
            )
        cls = model_class
    try:
        cfg = fam.to_config(types.SimpleNamespace(**raw), cls)
    except AttributeError as err:
        name = getattr(err, "name", None) or str(err)
        raise CheckpointError(
            f"{owner}: {where} has no field {name!r}, which the {cls} config needs."
        ) from None
    except ConfigError as err:
        raise ConfigError(f"{owner}: {where}: {err}") from None
    with open_catalog(folder) as catalog:
        stored = set(catalog.keys())
        cfg = fam.from_keys(cfg, cls, _base_keys(stored, fam.base_prefix))
        for key, source in fam.tied_keys(cfg, cls).items():
            if key in stored:
                a = catalog.read(key)
                b = catalog.read(source) if source in stored else None
                if b is None or a.shape != b.shape or not np.array_equal(a, b):
                    if fam.untie is not None:  # as transformers: keep both
                        cfg = fam.untie(cfg)
                        continue
                    raise CheckpointError(
                        f"{owner}: {folder}: {key} is tied to {source} by the {cls} "
                        "of config.json but the stored tensors differ."
                    )
                stored.discard(key)
        rules = fam.all_rules(cfg, cls)
        skeleton = _flat_skeleton(fam, cfg)
        shapes = param_shapes(skeleton)
        stored -= set(fam.ignored)
        expected = {r.hf: r.hf_shape([shapes[b] for b in r.bl]) for r in rules}
        sources = _sources(expected, stored, fam.base_prefix)
        missing = [k for k in expected if k not in sources]
        # reading another class of the family leaves the folder's heads out
        drop = fam.unused(cls)
        leftover = (
            sorted(k for k in stored - set(sources.values()) if not k.startswith(drop))
            if cls == stored_cls
            else []
        )
        if missing or leftover:
            whose = "its config.json" if cls == stored_cls else "model_class"
            note = (
                f" (transformers' {cls}.from_pretrained would draw them at random; "
                "blocklab loads only stored weights)"
                if cls != stored_cls and missing
                else ""
            )
            raise CheckpointError(
                f"{owner}: {folder}: the stored tensors do not match the {cls} of "
                f"{whose}: missing keys {missing}{note}; left-over keys {leftover}."
            )
        for key, shape in expected.items():
            info = catalog.infos[sources[key]]
            if info.shape != shape:
                raise CheckpointError(
                    f"{owner}: {info.file}: tensor {sources[key]!r} has shape "
                    f"{info.shape}; the config.json model expects {shape}."
                )
            info.check_float(owner, sources[key])
        ours: dict[str, np.ndarray] = {}
        for r in rules:
            arr = catalog.read(sources[r.hf])
            bad = _non_finite(arr)
            if bad is not None:
                raise CheckpointError(
                    f"{owner}: {catalog.infos[sources[r.hf]].file}: tensor "
                    f"{sources[r.hf]!r} {bad}."
                )
            ours.update(zip(r.bl, r.from_hf(arr), strict=True))
            del arr
    ours.update(_constants(fam, cfg, cls, shapes))
    model = _placed(skeleton, ours, dtype, sharding_of or (lambda path: None))
    return _complete(model, fam, cfg)


def _save_flat_pretrained(
    model: Any,
    folder: Path,
    fam: Family,
    *,
    max_bytes: int,
    overwrite: bool,
    token_ids: Mapping[str, Any] | None,
    generation_config: Mapping[str, Any] | None,
) -> Path:
    """`save_pretrained` for a family of the all-at-once layout (arguments
    checked there): `config.json`, `generation_config.json` when
    `Family.generation` or given, `model.safetensors` or shards, atomic."""
    owner = "save_pretrained"
    cfg = model.cfg
    cls = fam.class_of(cfg)
    fields = dict(fam.hf_fields(cfg))
    if token_ids:
        fields.update(token_ids)
    fields.update(architectures=[cls], model_type=fam.model_types[0], dtype="float32")
    config = {k: _json_value(v) for k, v in sorted(fields.items())}
    tensors = to_huggingface_state_dict(model, family=fam.name)
    sizes = [(k, v.nbytes) for k, v in tensors.items()]
    num_params = sum(v.size for v in tensors.values())
    generation = None
    if fam.generation or generation_config is not None:
        generation = dict(generation_config or {"_from_model_config": True})
        for k in ("decoder_start_token_id", "eos_token_id", "pad_token_id"):
            if k in config and k not in generation:
                generation[k] = config[k]
    with atomic_dir(folder, owner=owner, overwrite=overwrite) as tmp:
        for _ in write_shards(
            tmp,
            shard_plan(sizes, max_bytes),
            tensors.__getitem__,
            num_params=num_params,
        ):
            pass
        (tmp / CONFIG_NAME).write_text(
            json.dumps(config, indent=2, sort_keys=True) + "\n"
        )
        if generation is not None:
            (tmp / GENERATION_CONFIG_NAME).write_text(
                json.dumps(generation, indent=2, sort_keys=True) + "\n"
            )
    return folder
