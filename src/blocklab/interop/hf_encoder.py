r"""The conversion of the families whose rules are stated all at once.

The encoder and encoder–decoder families (BERT, ModernBERT, ViT, T5 / mT5 /
umT5, Whisper: modules of `interop.families`) are `Family`s like the
decoders, registered in the one `FAMILIES`; they state every stored tensor
at once (`Family.rules`, absolute names) instead of per layer, and may tie,
ignore, rename or hold constant some of them (`Family.tied`, `ignored`,
`disk_name`, `constants`). `from_huggingface`, `load_pretrained`,
`save_pretrained`, `to_huggingface_state_dict` and
`load_huggingface_state_dict` read that from the family and come here for
such a family. Loading reads each stored tensor once (safetensors, no
torch); the folder's keys and shapes are checked against the rules before
any tensor is converted.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._io import atomic_dir, check_folder_target, check_writable
from .._validate import ConfigError, check_bool
from ..training.checkpoint import CheckpointError
from .hf_common import FAMILIES, Family, eval_config
from .porting import (
    _converted,
    _is_param,
    _non_finite,
    _put,
    _walk,
    load_state_dict,
    param_shapes,
    state_dict,
)
from .safetensors_io import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    open_catalog,
    parse_size,
    shard_plan,
    write_shards,
)

__all__ = [
    "encoder_family_for_class",
    "encoder_family_of_config",
    "encoder_from_huggingface",
    "encoder_state_dict",
    "is_encoder_class",
    "is_encoder_model",
    "load_encoder_pretrained",
    "load_encoder_state_dict",
    "save_encoder_pretrained",
]


def _encoder_families() -> list[Family]:
    """The registered families of the all-at-once layout (`Family.rules`)."""
    return [f for f in FAMILIES.values() if not f.layered]


def is_encoder_class(name: str) -> bool:
    """Whether the `transformers` class `name` is an encoder family's."""
    return any(name in f.classes for f in _encoder_families())


def encoder_family_for_class(name: str) -> Family:
    """The family converting the `transformers` model class `name`."""
    for fam in _encoder_families():
        if name in fam.classes:
            return fam
    raise ConfigError(f"from_huggingface: the model class {name} is not supported.")


def is_encoder_model(model: Any) -> bool:
    """Whether some encoder family exports `model`."""
    return any(f.exports(model) for f in _encoder_families())


def encoder_family_of_config(
    raw: Mapping[str, Any],
) -> tuple[Family, str] | None:
    """The encoder family and model class of a `config.json` (its
    `architectures[0]`, else its `model_type`'s first class), or `None`."""
    archs = raw.get("architectures")
    if isinstance(archs, list):
        for name in archs:
            if isinstance(name, str) and is_encoder_class(name):
                fam = encoder_family_for_class(name)
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
    for fam in _encoder_families():
        if model_type in fam.model_types:
            return fam, fam.classes[0]
    return None


def _family(owner: str, model: Any, family: str | None) -> Family:
    if family is not None:
        fams = {f.name: f for f in _encoder_families()}
        fam = fams.get(family) or next(
            (f for f in fams.values() if family in f.classes), None
        )
        if fam is None or not fam.exports(model):
            raise ConfigError(
                f"{owner}: family={family!r} is not an encoder family that can "
                f"express a {type(model).__name__}; encoder families: "
                f"{sorted(fams)}."
            )
        return fam
    found = [f for f in _encoder_families() if f.exports(model)]
    if len(found) != 1:
        raise ConfigError(
            f"{owner}: no single encoder family expresses this "
            f"{type(model).__name__} (candidates: {[f.name for f in found]}); "
            "pass family=."
        )
    return found[0]


def _to_numpy(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # a torch tensor, without importing torch
        value = value.detach().cpu()
        if str(value.dtype) in ("torch.bfloat16", "torch.float16"):
            value = value.float()
        return value.numpy()
    return np.asarray(value)


def _complete(model: Any, fam: Family, cfg: Any) -> Any:
    """A model whose every leaf is concrete: the abstract leaves of a skeleton
    (per-layer windows, RoPE bases: integers) come from a model built for
    `cfg` in one compiled program that returns only them (its random weights
    are never computed), so the loaded parameters keep their placement."""

    def is_none(x):
        return x is None

    leaves, treedef = jax.tree_util.tree_flatten(model, is_leaf=is_none)
    if not any(isinstance(x, jax.ShapeDtypeStruct) for x in leaves):
        return model

    @eqx.filter_jit
    def data(key):
        return eqx.filter(fam.make(cfg, key=key), lambda x: not _is_param(x))

    built = jax.tree_util.tree_leaves(data(jax.random.key(0)), is_leaf=is_none)
    return treedef.unflatten(
        [b if isinstance(x, jax.ShapeDtypeStruct) else x
         for x, b in zip(leaves, built, strict=True)]
    )  # fmt: skip


def _path(names: Any) -> str:
    """The path `sharding=` is asked for: a parameter's dotted name, or for
    an array stacked over a `Stack`'s layers its name without the layer
    index (`stack.blocks.attention.W_q.weight`), as for the decoders."""
    if isinstance(names, str):
        return names
    return names.head + names[0][len(names.head) :].split(".", 1)[1]


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
        path = _path(names)
        if isinstance(names, str):
            array = np.asarray(ours[names])
        else:
            array = np.stack([np.asarray(ours[n]) for n in names])
        target = np.dtype(leaf.dtype if dtype is None else dtype)
        array = _converted(array, target, path, what="parameter", hint="")
        return _put(array, sharding_of(path))

    return _walk(skeleton, take)


def _base_keys(keys: Any, prefix: str) -> frozenset:
    """The stored names with the base model's `prefix` removed."""
    if not prefix:
        return frozenset(keys)
    return frozenset(k[len(prefix) :] if k.startswith(prefix) else k for k in keys)


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


def _skeleton(fam: Family, cfg: Any) -> Any:
    return eqx.filter_eval_shape(lambda k: fam.make(cfg, key=k), jax.random.key(0))


def _family_of_config(owner: str, cfg: Any) -> Family:
    found = []
    for fam in _encoder_families():
        try:
            if fam.exports(_skeleton(fam, cfg)):
                found.append(fam)
        except (ConfigError, TypeError, AttributeError):
            continue
    if len(found) != 1:
        raise ConfigError(
            f"{owner}: no single encoder family expresses this "
            f"{type(cfg).__name__} (candidates: {[f.name for f in found]}); pass "
            "family=."
        )
    return found[0]


def load_encoder_state_dict(
    cfg: Any,
    hf_state_dict: Mapping[str, Any],
    *,
    family: str | None = None,
    cls: str | None = None,
) -> Any:
    """The blocklab model of `cfg` with every weight from a `transformers`
    state dict of the family `family` (default: the one family that
    expresses `cfg`) and class `cls` (default: the class of `cfg`). Tied
    tensors may be present (they must equal what they tie to).

    Raises:
        ConfigError: a missing or unexpected key, a wrong shape (named), a
            tied tensor that differs from its source.
    """
    owner = "load_huggingface_state_dict"
    if family:
        fam = FAMILIES.get(family) or encoder_family_for_class(family)
    else:
        fam = _family_of_config(owner, cfg)
    cls = cls or fam.class_of(cfg)
    given = {k: v for k, v in hf_state_dict.items() if k not in fam.ignored}
    for key, source in fam.tied_keys(cfg, cls).items():
        if key in given:
            a = _to_numpy(given[key])
            b = _to_numpy(given[source]) if source in given else None
            if b is None or a.shape != b.shape or not np.array_equal(a, b):
                if fam.untie is not None:
                    cfg = fam.untie(cfg)
                    continue
                raise ConfigError(
                    f"{owner}: {key} is tied to {source} in the {cls} of this config "
                    "but differs from it."
                )
            del given[key]
    rules = fam.all_rules(cfg, cls)
    skeleton = _skeleton(fam, cfg)
    shapes = param_shapes(skeleton)
    expected = {r.hf: r.hf_shape([shapes[b] for b in r.bl]) for r in rules}
    missing = [k for k in expected if k not in given]
    drop = fam.unused(cls)
    unexpected = [k for k in given if k not in expected and not k.startswith(drop)]
    if missing or unexpected:
        raise ConfigError(
            f"{owner}: the state dict does not match the {cls} of this config: "
            f"missing keys {missing}; unexpected keys {unexpected}."
        )
    ours: dict[str, np.ndarray] = {}
    for r in rules:
        arr = _to_numpy(given[r.hf])
        if tuple(arr.shape) != expected[r.hf]:
            raise ConfigError(
                f"{owner}: key {r.hf!r} has shape {tuple(arr.shape)}, the {cls} of "
                f"this config expects {expected[r.hf]}."
            )
        ours.update(zip(r.bl, r.from_hf(arr), strict=True))
    ours.update(_constants(fam, cfg, cls, shapes))
    return _complete(load_state_dict(skeleton, ours), fam, cfg)


def _constants(fam, cfg, cls, shapes) -> dict[str, np.ndarray]:
    return {
        name: np.full(shapes[name], value, np.float32)
        for name, value in fam.constants(cfg, cls).items()
    }


def encoder_state_dict(
    model: Any, *, family: str | None = None
) -> dict[str, np.ndarray]:
    """The `transformers` state dict of an encoder-family `model`
    (`{key: numpy array}`, tied tensors left out as `save_pretrained` does)."""
    fam = _family("to_huggingface_state_dict", model, family)
    cls = fam.class_of(model.cfg)
    ours = state_dict(model)
    for name, value in fam.constants(model.cfg, cls).items():
        if not np.all(ours[name] == value):
            raise ConfigError(
                f"to_huggingface_state_dict: the {cls} has no parameter {name} (it "
                f"is {value} there), but this model's differs from {value}; the "
                "transformers model would compute other outputs."
            )
    return {
        r.hf: r.to_hf([ours[b] for b in r.bl]) for r in fam.all_rules(model.cfg, cls)
    }


def encoder_from_huggingface(hf_model: Any) -> Any:
    """The blocklab model of a `transformers` encoder-family PyTorch model
    (float32 weights); its outputs equal the PyTorch model's."""
    cls = type(hf_model).__name__
    fam = encoder_family_for_class(cls)
    hf_config = eval_config(hf_model, cls, fam.dropout_fields)
    cfg = fam.to_config(hf_config, cls)
    rename = fam.disk_name or (lambda k: k)
    sd = {rename(k): v.float() for k, v in hf_model.state_dict().items()}
    cfg = fam.from_keys(cfg, cls, _base_keys(sd, fam.base_prefix))
    return load_encoder_state_dict(cfg, sd, family=fam.name, cls=cls)


# Folders ---------------------------------------------------------------------------


def load_encoder_pretrained(
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
        skeleton = _skeleton(fam, cfg)
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


def _json_value(x: Any) -> Any:
    if isinstance(x, (tuple, list)):
        return [_json_value(v) for v in x]
    if isinstance(x, Mapping):
        return {str(k): _json_value(v) for k, v in x.items()}
    if isinstance(x, np.generic):
        return x.item()
    return x


def save_encoder_pretrained(
    model: Any,
    path: Any,
    *,
    max_shard_size: Any = "5GB",
    overwrite: Any = False,
    family: str | None = None,
    token_ids: Mapping[str, Any] | None = None,
    generation_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write an encoder-family `model` as a folder `transformers` loads
    (`config.json`, `generation_config.json` for encoder–decoders,
    `model.safetensors` or shards); atomic, as `save_pretrained`."""
    owner = "save_pretrained"
    folder = Path(path)
    max_bytes = parse_size(owner, max_shard_size)
    overwrite = check_bool(owner, "overwrite", overwrite)
    check_folder_target(folder, owner=owner, overwrite=overwrite)
    check_writable(folder / CONFIG_NAME, owner=owner, name="path")
    fam = _family(owner, model, family)
    cfg = model.cfg
    cls = fam.class_of(cfg)
    fields = dict(fam.hf_fields(cfg))
    if token_ids:
        fields.update(token_ids)
    fields.update(architectures=[cls], model_type=fam.model_types[0], dtype="float32")
    config = {k: _json_value(v) for k, v in sorted(fields.items())}
    tensors = encoder_state_dict(model, family=fam.name)
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
