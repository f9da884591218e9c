r"""Convert Hugging Face `transformers` decoder models to and from `DecoderLM`.

`from_huggingface(hf_model)` reads a PyTorch `GPT2LMHeadModel`,
`LlamaForCausalLM`, `Olmo2ForCausalLM`, `Gemma3ForCausalLM` (text),
`MixtralForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM`,
`Qwen3ForCausalLM`, `Gemma2ForCausalLM` or `Phi3ForCausalLM` with its config
and returns a `blocklab.DecoderLM` whose logits equal the PyTorch model's
(float32). `to_huggingface_state_dict(model)` is the inverse: a
`{name: numpy array}` dict in the `transformers` names and layouts, which
`load_huggingface_state_dict` (or `hf_model.load_state_dict` after
`torch.from_numpy`) reads back bit for bit.

This module is the conversion machinery only. Each family is a `Family` in
its own module of `interop.families` (`gpt2`, `llama`, `olmo2`, `gemma3`,
`mixtral`, `mistral`, `qwen2`, `qwen3`, `gemma2`, `phi3`; the encoders
`bert`, `modernbert`, `vit`, `t5`, `whisper`), built on the public helpers
of `interop.hf_common`, and registered in `FAMILIES` when imported (this
module imports the package, which imports every module in it);
`register_family` adds another without touching this module.

Export refuses what the target cannot express: `to_huggingface_state_dict`
raises `ConfigError` naming every setting of the model that the family's
config mapping cannot reproduce (`hf_common.unsupported_settings`), so an
exported state dict always drives the `transformers` model to blocklab's
logits. `torch` is imported only inside the functions that need it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._validate import ConfigError
from ..models.decoder import DecoderLM, set_layer_data
from ..models.decoder_config import DecoderConfig
from ..models.encoder_config import EncoderConfig, EncoderDecoderConfig
from . import families  # noqa: F401 - registers every family module
from .hf_common import (
    FAMILIES,
    Family,
    Rule,
    eval_config,
    family_for_class,
    get_field,
    register_family,
    resolve_family,
)
from .porting import _is_param, check_keys, load_state_dict, param_shapes, state_dict

__all__ = [
    "FAMILIES",
    "Family",
    "Rule",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "register_family",
    "to_huggingface_state_dict",
]


def _all_rules(cfg: DecoderConfig, fam: Family) -> list[tuple[str, Rule]]:
    """(hf key, rule) for every key of a decoder family, absolute names
    (`Family.all_rules`: embeddings first, then the layers, then the rest)."""
    return [(r.hf, r) for r in fam.all_rules(cfg)]


def hf_config_to_decoder(hf_config: Any, class_name: str) -> DecoderConfig:
    """The `DecoderConfig` of a `transformers` config for the model class `class_name`.

    Raises:
        ConfigError: an unsupported class, or a config field (named, with its
            value) that blocklab does not implement.
    """
    fam = family_for_class(class_name)
    if not fam.layered:
        raise ConfigError(
            f"hf_config_to_decoder: the model class {class_name} is of the "
            f"{fam.name} family, which converts no decoder (its models come from "
            "from_huggingface or load_pretrained)."
        )
    return fam.to_config(hf_config, class_name)


def to_huggingface_state_dict(
    model: Any, *, family: str | None = None
) -> dict[str, np.ndarray]:
    """The `transformers` state dict of `model`: `{key: numpy array}`.

    A `DecoderLM`, or an encoder-family model (BERT, ModernBERT, ViT, T5,
    Whisper), whose tied tensors are left out as `save_pretrained` of
    `transformers` leaves them out. One path for every family: its rules
    (`Family.all_rules`), after its constants are checked.

    Keys and layouts are those of the family's PyTorch model (`Conv1D`
    transposed and `c_attn` fused for GPT-2); a tied head has no
    `lm_head.weight` (as `save_pretrained` writes it). Load it into a PyTorch
    model with `hf_model.load_state_dict({k: torch.from_numpy(v) ...},
    strict=False)`, or back into blocklab with `load_huggingface_state_dict`
    (bit for bit). The `transformers` model of the config fields
    `FAMILIES[family].hf_fields(model.cfg)`, loaded with it, computes the
    model's logits: export succeeds only when the family can express every
    setting of the model.

    Args:
        model: a `DecoderLM`.
        family: a registered short name (`"gpt2"`, `"llama"`, `"olmo2"`,
            `"gemma3"`, `"mixtral"`, `"mistral"`, `"qwen2"`, `"qwen3"`,
            `"gemma2"`, `"phi3"`) or a class name; `None`: the one
            registered family that can express the model's config (a variant,
            `Family.variant_of`, yields to the family it generalizes).

    Raises:
        ConfigError: `model` is not a `DecoderLM`, `family` is unknown, or the
            family cannot express the model (naming each setting: a window,
            an attention scale, QK-norm, a norm placement, experts, ...).
    """
    owner = "to_huggingface_state_dict"
    fam = _exporting_family(owner, model, family)
    cls = fam.class_of(model.cfg)
    ours = state_dict(model)
    for name, value in fam.constants(model.cfg, cls).items():
        if not np.all(ours[name] == value):
            raise ConfigError(
                f"{owner}: the {cls} has no parameter {name} (it is {value} there), "
                f"but this model's differs from {value}; the transformers model "
                "would compute other outputs."
            )
    return {
        r.hf: r.to_hf([ours[b] for b in r.bl]) for r in fam.all_rules(model.cfg, cls)
    }


def _exporting_family(owner: str, model: Any, family: str | None) -> Family:
    """The family that exports `model`: named by `family` (a short name or a
    class name), else inferred: among the families whose `Family.owns`
    accepts the model, the one that can express it (`resolve_family` for a
    `DecoderLM`: its config mapping reproduces every setting).

    Raises:
        ConfigError: no family (or several) exports `model`, or the named one
            cannot (each setting named).
    """
    if _is_flat_model(model):  # the all-at-once layout: the encoders
        return _flat_family(owner, model, family)
    if not isinstance(model, DecoderLM):
        raise ConfigError(
            f"{owner}: model must be a DecoderLM, got {type(model).__name__}."
        )
    return resolve_family(owner, model.cfg, family, check=True)


def _to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy/JAX array or a torch tensor (bf16 -> float32)."""
    if hasattr(value, "detach"):  # torch.Tensor, without importing torch
        import torch

        value = value.detach().cpu()
        if value.dtype in (torch.bfloat16, torch.float16):
            value = value.to(torch.float32)
        return value.numpy()
    return np.asarray(value)


def load_huggingface_state_dict(
    model_or_config: Any,
    hf_state_dict: Mapping[str, Any],
    *,
    family: str | None = None,
) -> Any:
    """A `DecoderLM` with every weight taken from a `transformers` state dict.

    With an `EncoderConfig` or `EncoderDecoderConfig`, the encoder-family
    model of that config instead (BERT, ModernBERT, ViT, T5, Whisper).

    Args:
        model_or_config: a `DecoderLM` (its structure is kept, its weights
            replaced) or a `DecoderConfig` (a model is built for it).
        hf_state_dict: `{key: array or torch tensor}` in the family's names
            and layouts. For a tied head, `lm_head.weight` may be present and
            must equal the token embedding exactly.
        family: a family's short name or class name; `None`: the one
            registered family that can express the config. A named family
            loads into any config whose parameters its rules cover.

    Raises:
        ConfigError: a missing key, an unexpected key or a wrong shape
            (naming the key, and both shapes), or an `lm_head.weight` that
            differs from the tied embedding.
    """
    if isinstance(model_or_config, (EncoderConfig, EncoderDecoderConfig)):
        return _load_flat_state_dict(model_or_config, hf_state_dict, family=family)
    if isinstance(model_or_config, DecoderLM):
        model = model_or_config
    elif isinstance(model_or_config, DecoderConfig):
        model = _skeleton(model_or_config)
    else:
        raise ConfigError(
            "load_huggingface_state_dict: model_or_config must be a DecoderLM or "
            f"a DecoderConfig, got {type(model_or_config).__name__}."
        )
    cfg = model.cfg
    owner = "load_huggingface_state_dict"
    fam = resolve_family(owner, cfg, family, check=False)
    rules = _all_rules(cfg, fam)
    ours_shapes = param_shapes(model)
    expected = {
        hf: rule.hf_shape([ours_shapes[b] for b in rule.bl]) for hf, rule in rules
    }
    given = dict(hf_state_dict)
    tied_head = None
    if (
        cfg.tie_embeddings
        and "lm_head.weight" in given
        and "lm_head.weight" not in expected
    ):
        tied_head = _to_numpy(given.pop("lm_head.weight"))
    check_keys(
        owner,
        expected,
        given,
        f"the {fam.name} model of this config",
    )
    arrays = {}
    for hf, shape in expected.items():
        arr = _to_numpy(given[hf])
        if tuple(arr.shape) != shape:
            raise ConfigError(
                f"load_huggingface_state_dict: key {hf!r} has shape "
                f"{tuple(arr.shape)}, the {fam.name} model of this config expects "
                f"shape {shape}."
            )
        arrays[hf] = arr
    if tied_head is not None:
        emb = arrays[rules[0][0]]
        if tied_head.shape != emb.shape or not np.array_equal(tied_head, emb):
            raise ConfigError(
                "load_huggingface_state_dict: the config ties the head to the "
                "embedding (tie_word_embeddings=True) but lm_head.weight differs "
                f"from {rules[0][0]}; convert with tie_word_embeddings=False."
            )
    ours = {}
    for hf, rule in rules:
        ours.update(zip(rule.bl, rule.from_hf(arrays[hf]), strict=True))
    model = load_state_dict(model, ours)
    if isinstance(model_or_config, DecoderConfig):
        model = eqx.tree_at(lambda m: m.stack, model, set_layer_data(model.stack, cfg))
        abstract = [
            leaf
            for leaf in jax.tree_util.tree_leaves(model)
            if isinstance(leaf, jax.ShapeDtypeStruct)
        ]
        if abstract:  # a leaf neither a weight nor per-layer data: build it
            full = DecoderLM(cfg, key=jax.random.key(0))
            model = load_state_dict(full, state_dict(model))
    return model


def _skeleton(cfg: DecoderConfig) -> DecoderLM:
    """The structure of `DecoderLM(cfg)` without drawing (or compiling) any weight."""
    return eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))


#: Config fields that name the MLP activation, per family.
_ACT_FIELDS = ("hidden_act", "hidden_activation", "activation_function")


def _check_model_matches_config(cls: str, hf_model: Any, hf_config: Any) -> None:
    """Conversion reads the config, so the config must describe the model.

    Refuses weights on the meta device (not loaded), and an activation field
    edited after the model was built: `transformers` fixes each MLP's
    activation module at construction (`ACT2FN[config.hidden_act]`), so a
    later edit changes the config but not the torch model.
    """
    params = getattr(hf_model, "parameters", None)
    if callable(params):
        for p in params():
            if getattr(getattr(p, "device", None), "type", None) == "meta":
                raise ConfigError(
                    f"from_huggingface: the {cls}'s weights are on the meta device "
                    "(created without data, e.g. under init_empty_weights or "
                    "device_map='meta'); load the weights first (from_pretrained, "
                    "or to_empty() and load_state_dict)."
                )
            break
    try:
        from transformers.activations import ACT2FN
    except ImportError:  # pragma: no cover - a torch model implies transformers
        return
    modules = getattr(hf_model, "modules", None)
    if not callable(modules):
        return
    for field in _ACT_FIELDS:
        name = get_field(hf_config, field)
        if not isinstance(name, str) or name not in ACT2FN:
            continue
        want = type(ACT2FN[name])
        for m in modules():
            for attr in ("act_fn", "act"):
                got = getattr(m, attr, None)
                if (
                    got is not None
                    and type(got).__module__.startswith(("transformers", "torch"))
                    and type(got) is not want
                ):
                    raise ConfigError(
                        f"from_huggingface: config.{field}={name!r} but the {cls}'s "
                        f"MLP computes {type(got).__name__} (the config was edited "
                        "after the model was built); conversion follows the config, "
                        "so it would not equal the torch model. Restore the field, "
                        "or rebuild the model from the edited config."
                    )
        return


def from_huggingface(hf_model: Any) -> Any:
    """Convert a `transformers` PyTorch causal LM into a `DecoderLM`.

    Supported: `GPT2LMHeadModel`, `LlamaForCausalLM`, `Olmo2ForCausalLM`,
    `Gemma3ForCausalLM` (text), `MixtralForCausalLM`, `MistralForCausalLM`,
    `Qwen2ForCausalLM`, `Qwen3ForCausalLM`, `Gemma2ForCausalLM`,
    `Phi3ForCausalLM`, and any class added with `register_family`.
    Encoders and encoder–decoders (BERT, ModernBERT, ViT, T5, Whisper) give
    an `EncoderModel` or an `EncoderDecoderLM` instead, whose outputs equal
    the PyTorch model's.
    The result's `model(ids)` ((T,) or (B, T) integer ids) returns the
    PyTorch model's logits (`hf_model(ids).logits`) in float32. Weights are
    converted to float32.

    Raises:
        ConfigError: an unsupported class (named), a config field that
            blocklab does not implement (named, with its value), a model in
            training mode with dropout (call `hf_model.eval()`), or a head that
            the config ties but whose weights differ from the embedding.
    """
    cls = type(hf_model).__name__
    if _is_flat_class(cls):  # the all-at-once layout: the encoders
        return _flat_from_huggingface(hf_model)
    fam = family_for_class(cls)
    hf_config = eval_config(hf_model, cls, fam.dropout_fields)
    _check_model_matches_config(cls, hf_model, hf_config)
    cfg = fam.to_config(hf_config)
    sd = hf_model.state_dict()
    if cfg.tie_embeddings:
        head = getattr(hf_model, "lm_head", None)
        emb = hf_model.get_input_embeddings()
        if head is not None and head.weight is not emb.weight:
            # Not the same tensor: the conversion ties only if they are equal.
            if "lm_head.weight" not in sd:
                sd = dict(sd, **{"lm_head.weight": head.weight})
    return load_huggingface_state_dict(cfg, sd, family=fam.name)


# The all-at-once layout (Family.rules: the encoders) ----------------------------


def _flat_families() -> list[Family]:
    """The registered families of the all-at-once layout (`Family.rules`)."""
    return [f for f in FAMILIES.values() if not f.layered]


def _is_flat_class(name: str) -> bool:
    """Whether the `transformers` class `name` is an encoder family's."""
    return any(name in f.classes for f in _flat_families())


def _flat_family_for_class(name: str) -> Family:
    """The family converting the `transformers` model class `name`."""
    for fam in _flat_families():
        if name in fam.classes:
            return fam
    raise ConfigError(f"from_huggingface: the model class {name} is not supported.")


def _is_flat_model(model: Any) -> bool:
    """Whether some encoder family exports `model`."""
    return any(f.exports(model) for f in _flat_families())


def _flat_family(owner: str, model: Any, family: str | None) -> Family:
    if family is not None:
        fams = {f.name: f for f in _flat_families()}
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
    found = [f for f in _flat_families() if f.exports(model)]
    if len(found) != 1:
        raise ConfigError(
            f"{owner}: no single encoder family expresses this "
            f"{type(model).__name__} (candidates: {[f.name for f in found]}); "
            "pass family=."
        )
    return found[0]


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


def _base_keys(keys: Any, prefix: str) -> frozenset:
    """The stored names with the base model's `prefix` removed."""
    if not prefix:
        return frozenset(keys)
    return frozenset(k[len(prefix) :] if k.startswith(prefix) else k for k in keys)


def _flat_skeleton(fam: Family, cfg: Any) -> Any:
    return eqx.filter_eval_shape(lambda k: fam.make(cfg, key=k), jax.random.key(0))


def _flat_family_of_cfg(owner: str, cfg: Any) -> Family:
    found = []
    for fam in _flat_families():
        try:
            if fam.exports(_flat_skeleton(fam, cfg)):
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


def _load_flat_state_dict(
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
        fam = FAMILIES.get(family) or _flat_family_for_class(family)
    else:
        fam = _flat_family_of_cfg(owner, cfg)
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
    skeleton = _flat_skeleton(fam, cfg)
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


def _flat_from_huggingface(hf_model: Any) -> Any:
    """The blocklab model of a `transformers` encoder-family PyTorch model
    (float32 weights); its outputs equal the PyTorch model's."""
    cls = type(hf_model).__name__
    fam = _flat_family_for_class(cls)
    hf_config = eval_config(hf_model, cls, fam.dropout_fields)
    cfg = fam.to_config(hf_config, cls)
    rename = fam.disk_name or (lambda k: k)
    sd = {rename(k): v.float() for k, v in hf_model.state_dict().items()}
    cfg = fam.from_keys(cfg, cls, _base_keys(sd, fam.base_prefix))
    return _load_flat_state_dict(cfg, sd, family=fam.name, cls=cls)
