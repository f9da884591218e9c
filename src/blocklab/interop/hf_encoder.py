r"""Encoder and encoder–decoder families of `transformers`: registry and conversion.

The decoder families (`interop.hf_common.HFFamily`) map a `transformers`
config onto a `DecoderConfig`; the families here (BERT, ModernBERT, ViT, T5 /
umT5, one module each: `interop.bert`, `.modernbert`, `.vit`, `.t5`) map one
onto the config of an encoder or encoder–decoder model of `blocklab.nn`, and
state-dict keys onto its parameters. Each is an `EncoderFamily`:

- `to_config(hf_config, cls)`: the blocklab config of the model class `cls`,
  refusing by name every config field that changes the maths and is not
  implemented (an allow-list, `FIELDS` of each module, read by
  `hf_common.understood`);
- `hf_fields(cfg)`: the way back (the `transformers` config fields);
- `rules(cfg, cls)`: every stored tensor, its blocklab parameter(s) and its
  layout (`EncRule`), with absolute names on both sides;
- `build(cfg, key)`: the blocklab model.

`from_huggingface`, `load_pretrained` and `save_pretrained` dispatch here for
the classes and `model_type`s registered in `ENCODER_FAMILIES`. Loading reads
each stored tensor once (safetensors, no torch); the folder's keys and shapes
are checked against the rules before any tensor is converted.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._io import atomic_dir, check_folder_target, check_writable
from .._validate import ConfigError, check_bool, check_choice
from ..training.checkpoint import CheckpointError
from .hf_common import eval_config
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
    "ENCODER_FAMILIES",
    "EncRule",
    "EncoderFamily",
    "encoder_family_for_class",
    "encoder_family_of_config",
    "encoder_from_huggingface",
    "encoder_state_dict",
    "is_encoder_class",
    "is_encoder_model",
    "load_encoder_pretrained",
    "load_encoder_state_dict",
    "register_encoder_family",
    "save_encoder_pretrained",
]

#: The layouts of an `EncRule`: `"same"` (copied), `"T"` (transposed), `"cat"`
#: (the blocklab arrays concatenated along axis 0: ModernBERT's fused `Wqkv`
#: and `Wi`), `"lead"` (the stored tensor has `lead` leading axes of size 1:
#: ViT's `cls_token` `(1, 1, d)` and position table `(1, N + 1, d)`).
ENC_RULE_KINDS = ("same", "T", "cat", "lead")

#: BERT / ViT `hidden_act` -> blocklab's `act` (their `"gelu"` is the exact
#: erf GELU, `"gelu_new"` the tanh one), and blocklab's `act` -> `hidden_act`.
BERT_ACTS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
             "relu": "relu"}  # fmt: skip
HF_BERT_ACTS = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}


@dataclasses.dataclass(frozen=True)
class EncRule:
    """One stored tensor `hf` and the blocklab parameter(s) `bl` it holds.

    Names are absolute on both sides (`"bert.encoder.layer.0.attention.self.
    query.weight"`, `("encoder.stack.blocks.0.attention.W_q.weight",)`).
    """

    hf: str
    bl: tuple[str, ...]
    kind: str = "same"
    lead: int = 0

    def __post_init__(self):
        check_choice("EncRule", "kind", self.kind, ENC_RULE_KINDS)

    def to_hf(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        if self.kind == "same":
            return np.asarray(arrays[0])
        if self.kind == "T":
            return np.ascontiguousarray(np.asarray(arrays[0]).T)
        if self.kind == "cat":
            return np.concatenate([np.asarray(a) for a in arrays], axis=0)
        a = np.asarray(arrays[0])
        return a.reshape((1,) * self.lead + a.shape)

    def from_hf(self, array: np.ndarray) -> list[np.ndarray]:
        if self.kind == "same":
            return [array]
        if self.kind == "T":
            return [np.ascontiguousarray(array.T)]
        if self.kind == "cat":
            return [
                np.ascontiguousarray(a) for a in np.split(array, len(self.bl), axis=0)
            ]
        return [array.reshape(array.shape[self.lead :])]

    def hf_shape(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        if self.kind == "same":
            return tuple(shapes[0])
        if self.kind == "T":
            return tuple(shapes[0])[::-1]
        if self.kind == "cat":
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        return (1,) * self.lead + tuple(shapes[0])


def label_fields(num_labels: int) -> dict[str, dict]:
    """`id2label` and `label2id` of a classifier of `num_labels` classes
    (`transformers`' default names `LABEL_i`)."""
    return {
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(num_labels)},
    }


def layer_rules(
    num_blks: int, hf_prefix: str, layer: Sequence[tuple[str, str, bool]]
) -> list[EncRule]:
    """The `EncRule`s of a stack's layers: for layer $i$ and each `(hf, ours,
    biased)` of `layer`, `{hf_prefix}{i}.{hf}.weight` holds
    `stack.blocks.{i}.{ours}.weight` (and `.bias` the bias when `biased`)."""
    return [
        EncRule(f"{hf_prefix}{i}.{hf}.{n}", (f"stack.blocks.{i}.{ours}.{n}",))
        for i in range(num_blks)
        for hf, ours, biased in layer
        for n in (("weight", "bias") if biased else ("weight",))
    ]


@dataclasses.dataclass(frozen=True)
class EncoderFamily:
    """How one `transformers` encoder (or encoder–decoder) family maps onto blocklab.

    Attributes:
        name: short name (`"bert"`), accepted as `family=`.
        classes: the `transformers` model classes it converts (the first is
            what `save_pretrained` writes when the model does not say).
        model_types: the `model_type`s of its `config.json`; the first is
            written.
        to_config: `to_config(hf_config, cls) -> cfg`; refuses (naming the
            field and its value) what blocklab does not implement.
        hf_fields: `hf_fields(cfg) -> dict` of `transformers` config fields.
        rules: `rules(cfg, cls) -> list[EncRule]`.
        build: `build(cfg, key) -> model`.
        model_class: `model_class(cfg) -> cls`: the `transformers` class of a
            blocklab config (what `save_pretrained` names in `architectures`).
        owns: `owns(model) -> bool`: the blocklab models it exports.
        dropout_fields: config fields holding dropout rates, refused while
            the PyTorch model is in training mode.
        tied: `tied(cfg, cls) -> {stored key: the stored key it equals}`,
            tensors `transformers` ties and `save_pretrained` leaves out (a
            file may still hold them: they are checked equal and dropped).
        ignored: stored keys that `transformers` itself ignores on load.
        unused: `unused(cls) -> prefixes`: tensors of the family's other
            classes that `cls` does not use and that `transformers` leaves
            out when it loads them into `cls` (BERT's pre-training
            checkpoints, `bert-base-uncased` among them, are stored with
            `architectures` `BertForMaskedLM` but also hold the pooler
            `bert.pooler.*` and the next-sentence head
            `cls.seq_relationship.*`); any other extra tensor is refused.
        untie: `untie(cfg) -> cfg` with its own head, for a family whose
            stored head may differ from the tied embedding (T5: `transformers`
            then keeps them untied); `None`: a differing tied tensor is an
            error.
        constants: `constants(cfg, cls) -> {blocklab parameter: value}`, the
            parameters the `transformers` model does not have, with the
            constant they hold there (ModernBERT's LayerNorm biases without
            `norm_bias`: 0; its layer 0's absent attention norm); export
            refuses a model whose parameter differs from it.
        disk_name: `disk_name(key)`: the name on disk of an in-memory
            state-dict key, for a family that `transformers` renames on load
            (ViT); `None`: the same names.
        base_prefix: the prefix of the base model's tensors in the head
            classes (`"bert."`; the base class, `BertModel`, has none). A
            stored key is read with or without it, as `transformers` reads a
            base folder into a head class and a head folder into the base.
        from_keys: `from_keys(cfg, cls, keys) -> cfg`: the config as the
            stored tensors settle what `config.json` does not say (`BertModel`,
            `ViTModel`: the pooler is there iff its tensors are; `keys` are the
            stored names with `base_prefix` removed).
    """

    name: str
    classes: tuple[str, ...]
    model_types: tuple[str, ...]
    to_config: Callable[[Any, str], Any]
    hf_fields: Callable[[Any], dict[str, Any]]
    rules: Callable[[Any, str], list[EncRule]]
    build: Callable[..., Any]
    model_class: Callable[[Any], str]
    owns: Callable[[Any], bool]
    dropout_fields: tuple[str, ...] = ()
    tied: Callable[[Any, str], Mapping[str, str]] = lambda cfg, cls: {}
    ignored: tuple[str, ...] = ()
    unused: Callable[[str], tuple[str, ...]] = lambda cls: ()
    untie: Callable[[Any], Any] | None = None
    disk_name: Callable[[str], str] | None = None
    constants: Callable[[Any, str], Mapping[str, float]] = lambda cfg, cls: {}
    base_prefix: str = ""
    from_keys: Callable[[Any, str, frozenset], Any] = lambda cfg, cls, keys: cfg


#: Registered encoder families by short name.
ENCODER_FAMILIES: dict[str, EncoderFamily] = {}


def register_encoder_family(family: EncoderFamily) -> EncoderFamily:
    """Add `family` to `ENCODER_FAMILIES`; returns it."""
    if not isinstance(family, EncoderFamily):
        raise ConfigError(
            "register_encoder_family: family must be an EncoderFamily, got "
            f"{type(family).__name__}."
        )
    ENCODER_FAMILIES[family.name] = family
    return family


def is_encoder_class(name: str) -> bool:
    """Whether the `transformers` class `name` is an encoder family's."""
    return any(name in f.classes for f in ENCODER_FAMILIES.values())


def encoder_family_for_class(name: str) -> EncoderFamily:
    """The family converting the `transformers` model class `name`."""
    for fam in ENCODER_FAMILIES.values():
        if name in fam.classes:
            return fam
    raise ConfigError(f"from_huggingface: the model class {name} is not supported.")


def is_encoder_model(model: Any) -> bool:
    """Whether some encoder family exports `model`."""
    return any(f.owns(model) for f in ENCODER_FAMILIES.values())


def encoder_family_of_config(
    raw: Mapping[str, Any],
) -> tuple[EncoderFamily, str] | None:
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
    for fam in ENCODER_FAMILIES.values():
        if model_type in fam.model_types:
            return fam, fam.classes[0]
    return None


def _family(owner: str, model: Any, family: str | None) -> EncoderFamily:
    if family is not None:
        fam = ENCODER_FAMILIES.get(family) or next(
            (f for f in ENCODER_FAMILIES.values() if family in f.classes), None
        )
        if fam is None or not fam.owns(model):
            raise ConfigError(
                f"{owner}: family={family!r} is not an encoder family that can "
                f"express a {type(model).__name__}; encoder families: "
                f"{sorted(ENCODER_FAMILIES)}."
            )
        return fam
    found = [f for f in ENCODER_FAMILIES.values() if f.owns(model)]
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


def _complete(model: Any, fam: EncoderFamily, cfg: Any) -> Any:
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
        return eqx.filter(fam.build(cfg, key=key), lambda x: not _is_param(x))

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


def _skeleton(fam: EncoderFamily, cfg: Any) -> Any:
    return eqx.filter_eval_shape(lambda k: fam.build(cfg, key=k), jax.random.key(0))


def _family_of_config(owner: str, cfg: Any) -> EncoderFamily:
    found = []
    for fam in ENCODER_FAMILIES.values():
        try:
            if fam.owns(_skeleton(fam, cfg)):
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
        fam = ENCODER_FAMILIES.get(family) or encoder_family_for_class(family)
    else:
        fam = _family_of_config(owner, cfg)
    cls = cls or fam.model_class(cfg)
    given = {k: v for k, v in hf_state_dict.items() if k not in fam.ignored}
    for key, source in fam.tied(cfg, cls).items():
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
    rules = fam.rules(cfg, cls)
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
    cls = fam.model_class(model.cfg)
    ours = state_dict(model)
    for name, value in fam.constants(model.cfg, cls).items():
        if not np.all(ours[name] == value):
            raise ConfigError(
                f"to_huggingface_state_dict: the {cls} has no parameter {name} (it "
                f"is {value} there), but this model's differs from {value}; the "
                "transformers model would compute other outputs."
            )
    return {r.hf: r.to_hf([ours[b] for b in r.bl]) for r in fam.rules(model.cfg, cls)}


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
    fam: EncoderFamily,
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
        for key, source in fam.tied(cfg, cls).items():
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
        rules = fam.rules(cfg, cls)
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
    cls = fam.model_class(cfg)
    fields = dict(fam.hf_fields(cfg))
    if token_ids:
        fields.update(token_ids)
    fields.update(architectures=[cls], model_type=fam.model_types[0], dtype="float32")
    config = {k: _json_value(v) for k, v in sorted(fields.items())}
    tensors = encoder_state_dict(model, family=fam.name)
    sizes = [(k, v.nbytes) for k, v in tensors.items()]
    num_params = sum(v.size for v in tensors.values())
    generation = None
    if getattr(fam, "name", "") in ("t5", "umt5") or generation_config is not None:
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
