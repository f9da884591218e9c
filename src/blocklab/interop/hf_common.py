r"""What every Hugging Face family shares: rules, the registry, config helpers.

A family (one module each in `interop.families`: `gpt2`, `llama`, ...,
`bert`, `t5`, `whisper`) is a `Family`, decoders and encoders alike: a config
mapping in both directions (`to_config`: the `transformers` config -> the
blocklab config, refusing every field blocklab does not implement;
`hf_fields`: the way back) and the `Rule`s that map state-dict keys onto
blocklab parameters, per layer (the decoders) or all at once (the encoders).
The public helpers below are what the family modules build on; the conversion
itself (`from_huggingface`, ...) lives in `interop.huggingface`.

Expressibility. A family can express a `DecoderConfig` `cfg` exactly when its
config mapping reproduces it: every setting that determines the forward pass
(`forward_settings`) of `to_config(hf_fields(cfg))` equals that of `cfg`.
Then the `transformers` model built from `hf_fields(cfg)`, loaded with the
exported state dict, computes blocklab's logits; any other setting is named by
`unsupported_settings`, and export refuses it.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._validate import ConfigError, check_choice
from ..models.decoder import DecoderLM
from ..models.decoder_config import DecoderConfig
from ..nn.ffn import ffn_width

__all__ = [
    "BERT_ACTS",
    "Derived",
    "FAMILIES",
    "HARMLESS_FIELDS",
    "HF_ACT_TO_GATED",
    "HF_BERT_ACTS",
    "Family",
    "LAYER_TYPES",
    "RULE_KINDS",
    "Rule",
    "StoredAs",
    "attn_rules",
    "biased",
    "config_fields",
    "decoder_config",
    "decoder_families",
    "decoder_fields",
    "family_for_class",
    "forward_settings",
    "gated_act",
    "get_field",
    "global_layers_of",
    "hf_gated_act",
    "label_fields",
    "layer_types_of",
    "legacy_rope",
    "llama_like",
    "llama_like_fields",
    "mlp_rules",
    "model_global_rules",
    "no_softcapping",
    "pre_norm_layer",
    "qk_norm_rules",
    "refuse",
    "register_family",
    "register_llama_layout",
    "require",
    "resolve_family",
    "rope_fields",
    "rope_theta",
    "stack_rules",
    "understood",
    "unsupported_settings",
]


# State-dict rules ------------------------------------------------------------

#: The layouts of a `Rule`: `"same"` (copied), `"T"` (transposed), `"cat_T"`
#: (the transposed arrays concatenated along columns: GPT-2's fused
#: `c_attn.weight`), `"cat"` (concatenated along axis 0: its fused bias,
#: Phi-3's `qkv_proj` and `gate_up_proj`, ModernBERT's `Wqkv` and `Wi`),
#: `"cat1"` (concatenated along axis 1: Mixtral's fused expert
#: `gate_up_proj`), `"lead"` (the stored tensor has `lead` leading axes of
#: size 1: ViT's `cls_token` `(1, 1, d)` and position table `(1, N + 1, d)`).
RULE_KINDS = ("same", "T", "cat_T", "cat", "cat1", "lead")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Hugging Face key and the blocklab parameter(s) it holds.

    Attributes:
        hf: the `transformers` key (a family's `layer_rules`: relative to the
            layer prefix, e.g. `"self_attn.q_proj.weight"`; its `rules` and
            `global_rules`: absolute).
        bl: the blocklab names (`layer_rules`: relative to the block, e.g.
            `("attention.W_q.weight",)`; else absolute).
        kind: the layout, one of `RULE_KINDS`.
        sizes: for `"cat"`, the length of each part along axis 0 when they
            differ (Phi-3's fused `qkv_proj`: $Hp, Kp, Kp$ rows); `()`:
            equal parts.
        lead: for `"lead"`, the number of leading axes of size 1.
    """

    hf: str
    bl: tuple[str, ...]
    kind: str = "same"
    sizes: tuple[int, ...] = ()
    lead: int = 0

    def __post_init__(self):
        check_choice("Rule", "kind", self.kind, RULE_KINDS)

    def to_hf(self, arrays: Sequence[np.ndarray]) -> np.ndarray:
        """The Hugging Face array from the blocklab arrays (in `bl` order)."""
        arrays = [np.asarray(a) for a in arrays]
        if self.kind == "same":
            return arrays[0]
        if self.kind == "T":
            return np.ascontiguousarray(arrays[0].T)
        if self.kind == "cat_T":
            return np.concatenate([a.T for a in arrays], axis=1)
        if self.kind == "cat":
            return np.concatenate(arrays, axis=0)
        if self.kind == "lead":
            return arrays[0].reshape((1,) * self.lead + arrays[0].shape)
        return np.concatenate(arrays, axis=1)  # "cat1"

    def from_hf(self, array: np.ndarray) -> list[np.ndarray]:
        """The blocklab arrays (in `bl` order) from the Hugging Face array."""
        n = len(self.bl)
        if self.kind == "same":
            return [array]
        if self.kind == "T":
            return [np.ascontiguousarray(array.T)]
        if self.kind == "cat_T":
            return [np.ascontiguousarray(a.T) for a in np.split(array, n, axis=1)]
        if self.kind == "cat":
            cuts = np.cumsum(self.sizes)[:-1] if self.sizes else n
            return [np.ascontiguousarray(a) for a in np.split(array, cuts, axis=0)]
        if self.kind == "lead":
            return [array.reshape(array.shape[self.lead :])]
        return [np.ascontiguousarray(a) for a in np.split(array, n, axis=1)]

    def hf_shape(self, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
        """The Hugging Face shape from the blocklab shapes (in `bl` order)."""
        if self.kind == "same":
            return tuple(shapes[0])
        if self.kind == "T":
            return tuple(shapes[0])[::-1]
        if self.kind == "cat_T":
            return (shapes[0][1], sum(s[0] for s in shapes))
        if self.kind == "cat":
            return (sum(s[0] for s in shapes), *shapes[0][1:])
        if self.kind == "lead":
            return (1,) * self.lead + tuple(shapes[0])
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])


def biased(rules: list[Rule], flag: bool) -> list[Rule]:
    """Add the bias rule after each weight rule when `flag` (a fused `cat_T`
    weight has a `cat` bias; any other, a copied one)."""
    if not flag:
        return rules
    out = []
    for r in rules:
        out.append(r)
        out.append(
            Rule(
                r.hf.replace(".weight", ".bias"),
                tuple(b.replace(".weight", ".bias") for b in r.bl),
                "cat" if r.kind == "cat_T" else "same",
            )
        )
    return out


def attn_rules(cfg: DecoderConfig) -> list[Rule]:
    """`self_attn.{q,k,v,o}_proj` (Llama-style names), with biases if any
    (on `o_proj` when `cfg.block.attn_out_bias`)."""
    qkv = [
        Rule(f"self_attn.{n}_proj.weight", (f"attention.W_{n}.weight",)) for n in "qkv"
    ]
    o = [Rule("self_attn.o_proj.weight", ("attention.W_o.weight",))]
    return biased(qkv, cfg.attn_bias) + biased(o, cfg.block.attn_out_bias)


def mlp_rules(cfg: DecoderConfig) -> list[Rule]:
    """The gated MLP `mlp.{gate,up,down}_proj`, with biases if any."""
    return biased(
        [
            Rule("mlp.gate_proj.weight", ("ffn.W_g.weight",)),
            Rule("mlp.up_proj.weight", ("ffn.W_1.weight",)),
            Rule("mlp.down_proj.weight", ("ffn.W_2.weight",)),
        ],
        cfg.ffn_bias,
    )


def qk_norm_rules(cfg: DecoderConfig) -> list[Rule]:
    """`self_attn.{q,k}_norm` gains when the config has QK-norm."""
    if cfg.qk_norm is False:
        return []
    return [
        Rule("self_attn.q_norm.weight", ("attention.q_norm.weight",)),
        Rule("self_attn.k_norm.weight", ("attention.k_norm.weight",)),
    ]


def pre_norm_layer(attn: list[Rule], mlp: list[Rule]) -> list[Rule]:
    """One pre-norm block in Llama's names: `input_layernorm` (`norm1`), the
    attention's rules `attn`, `post_attention_layernorm` (`norm2`: despite its
    name, the norm the MLP reads), the MLP's rules `mlp`."""
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *attn,
        Rule("post_attention_layernorm.weight", ("norm2.weight",)),
        *mlp,
    ]


@dataclasses.dataclass(frozen=True)
class StoredAs:
    """How a checkpoint file stores one state-dict tensor as several tensors
    (`transformers` keeps older on-disk layouts and converts on load: Mixtral's
    fused experts are stored one `w1`/`w2`/`w3` per expert).

    Attributes:
        keys: the stored keys, in the order `join` takes them.
        join: the stored arrays (in `keys` order) -> the state-dict array.
        split: the state-dict array -> the stored arrays (in `keys` order).
    """

    keys: tuple[str, ...]
    join: Callable[[list[np.ndarray]], np.ndarray]
    split: Callable[[np.ndarray], list[np.ndarray]]


def model_global_rules(cfg: DecoderConfig) -> list[Rule]:
    """`model.embed_tokens`, `model.norm` and, when untied, `lm_head`."""
    rules = [
        Rule("model.embed_tokens.weight", ("token_emb.weight",)),
        Rule("model.norm.weight", ("norm.weight",)),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("head.weight",)))
    return rules


# The registry ------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    """How one `transformers` model family maps onto a blocklab model.

    One type for every family, decoders (`DecoderLM`) and encoders or
    encoder–decoders (`EncoderModel`, `EncoderDecoderLM`) alike: a config
    mapping in both directions and the `Rule`s of its state dict. A family
    states its rules in one of two layouts: per layer (`layer_prefix`,
    `layer_rules`, `global_rules`: the decoders, whose layers are one scanned
    stack) or all at once (`rules`: the encoders). Everything else is
    optional, with the decoders' behaviour as default.

    Attributes:
        name: short name (`"llama"`), accepted as `family=`.
        classes: the `transformers` model class names it converts (the first
            is what `save_pretrained` writes unless `model_class` says).
        to_config: `to_config(hf_config, cls) -> cfg`, the blocklab config
            of the model class `cls` (a family of one class may ignore it);
            raises `ConfigError` naming any field blocklab does not implement
            and its value (`understood` with `fields`). It reads the config
            with `getattr` only, so any attribute holder works.
        hf_fields: `hf_fields(cfg) -> dict`, the `transformers` config fields
            of a blocklab config (the inverse of `to_config` on the configs
            the family can express; see `unsupported_settings`).
        layer_prefix: per-layer layout: the prefix of layer `i`'s keys, with
            `{i}`.
        layer_rules: per-layer layout: `layer_rules(cfg)` -> the `Rule`s of
            one layer (names relative to the prefix and to the block).
        global_rules: per-layer layout: `global_rules(cfg)` -> the `Rule`s
            outside the layers (embeddings, final norm, untied head).
        rules: all-at-once layout: `rules(cfg, cls)` -> every `Rule`, with
            absolute names on both sides.
        build: `build(cfg, key=key)` -> the blocklab model; `None`:
            `DecoderLM`.
        model_class: `model_class(cfg) -> cls`, the `transformers` class of a
            blocklab config; `None`: `classes[0]`.
        owns: `owns(model) -> bool`, the blocklab models it exports; `None`:
            every `DecoderLM` (which of them it can express is then
            `unsupported_settings`).
        dropout_fields: config fields holding dropout rates, refused while
            the PyTorch model is in training mode.
        fields: every config field the family understands, with its
            `transformers` default (a `Derived` for one computed from the
            other fields): what `understood` accepts besides
            `HARMLESS_FIELDS`. Empty: no check.
        variant_of: the name of a family this one generalizes (Mistral is a
            Llama with a window); when both can express a config, inference
            (`resolve_family` without `family=`) picks `variant_of`.
        model_types: the `model_type`s of its `config.json` (the first is
            what `save_pretrained` writes; any is recognized by
            `load_pretrained` when `architectures` is absent); `()`:
            `(name,)`.
        stored_as: `stored_as(cfg)` -> `{state-dict key: StoredAs}` for the
            tensors a checkpoint file stores in another layout than the
            state dict (`None`: every tensor as in the state dict).
        tied: `tied(cfg, cls) -> {stored key: the stored key it equals}`,
            tensors `transformers` ties and `save_pretrained` leaves out (a
            file may still hold them: they are checked equal and dropped);
            `None`: the decoders' rule, `lm_head.weight` tied to the token
            embedding when `cfg.tie_embeddings`.
        ignored: stored keys that `transformers` itself ignores on load.
        unused: `unused(cls) -> prefixes`: tensors of the family's other
            classes that `cls` does not use and that `transformers` leaves
            out when it loads them into `cls` (BERT's pre-training
            checkpoints hold the pooler and the next-sentence head); any
            other extra tensor is refused.
        untie: `untie(cfg) -> cfg` with its own head, for a family whose
            stored head may differ from the tied embedding (T5: `transformers`
            then keeps them untied); `None`: a differing tied tensor is an
            error.
        constants: `constants(cfg, cls) -> {blocklab parameter: value}`, the
            parameters the `transformers` model does not have, with the
            constant they hold there (ModernBERT's LayerNorm biases without
            `norm_bias`); export refuses a model whose parameter differs.
        disk_name: `disk_name(key)`: the name on disk of an in-memory
            state-dict key, for a family that `transformers` renames on load
            (ViT); `None`: the same names.
        base_prefix: the prefix of the base model's tensors in the head
            classes (`"bert."`). A stored key is read with or without it.
        from_keys: `from_keys(cfg, cls, keys) -> cfg`: the config as the
            stored tensors settle what `config.json` does not say (`BertModel`:
            the pooler is there iff its tensors are).
        generation: `save_pretrained` writes `generation_config.json` even
            when none is given (the decoders and T5 / umT5, whose
            `transformers` classes generate).
    """

    name: str
    classes: tuple[str, ...]
    to_config: Callable[..., Any]
    hf_fields: Callable[[Any], dict[str, Any]]
    layer_prefix: str = ""
    layer_rules: Callable[[Any], list[Rule]] | None = None
    global_rules: Callable[[Any], list[Rule]] | None = None
    rules: Callable[[Any, str], list[Rule]] | None = None
    build: Callable[..., Any] | None = None
    model_class: Callable[[Any], str] | None = None
    owns: Callable[[Any], bool] | None = None
    dropout_fields: tuple[str, ...] = ("attention_dropout",)
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    variant_of: str | None = None
    model_types: tuple[str, ...] = ()
    stored_as: Callable[[Any], Mapping[str, StoredAs]] | None = None
    tied: Callable[[Any, str], Mapping[str, str]] | None = None
    ignored: tuple[str, ...] = ()
    unused: Callable[[str], tuple[str, ...]] = lambda cls: ()
    untie: Callable[[Any], Any] | None = None
    constants: Callable[[Any, str], Mapping[str, float]] = lambda cfg, cls: {}
    disk_name: Callable[[str], str] | None = None
    base_prefix: str = ""
    from_keys: Callable[[Any, str, frozenset], Any] = lambda cfg, cls, keys: cfg
    generation: bool = False

    def __post_init__(self):
        layered = self.layer_rules is not None and self.global_rules is not None
        if layered == (self.rules is not None) or (
            layered and "{i}" not in self.layer_prefix
        ):
            raise ConfigError(
                f"Family {self.name!r}: give either rules= (every key, absolute "
                "names) or layer_prefix= (with '{i}'), layer_rules= and "
                f"global_rules=; got rules={self.rules!r}, layer_prefix="
                f"{self.layer_prefix!r}, layer_rules={self.layer_rules!r}, "
                f"global_rules={self.global_rules!r}."
            )
        if not self.model_types:
            object.__setattr__(self, "model_types", (self.name,))

    @property
    def layered(self) -> bool:
        """Whether the family's rules are per layer (a `DecoderLM`'s stack)."""
        return self.rules is None

    def class_of(self, cfg: Any) -> str:
        """The `transformers` class of the blocklab config `cfg`."""
        return self.classes[0] if self.model_class is None else self.model_class(cfg)

    def exports(self, model: Any) -> bool:
        """Whether the family exports `model` (`owns`)."""
        if self.owns is None:
            return isinstance(model, DecoderLM)
        return bool(self.owns(model))

    def make(self, cfg: Any, *, key: Any) -> Any:
        """The blocklab model of `cfg` (`build`)."""
        if self.build is None:
            return DecoderLM(cfg, key=key)
        return self.build(cfg, key=key)

    def tied_keys(self, cfg: Any, cls: str) -> Mapping[str, str]:
        """`tied(cfg, cls)`: the stored keys tied to another."""
        if self.tied is not None:
            return self.tied(cfg, cls)
        if self.layered and cfg.tie_embeddings:
            return {"lm_head.weight": self.all_rules(cfg, cls)[0].hf}
        return {}

    def all_rules(self, cfg: Any, cls: str | None = None) -> list[Rule]:
        """Every `Rule` of the state dict, absolute names on both sides
        (per-layer layout: embeddings first, then the layers, then the rest,
        PyTorch's order)."""
        if self.rules is not None:
            return list(self.rules(cfg, cls or self.class_of(cfg)))
        rules = self.global_rules(cfg)
        embed = ("token_emb.weight", "pos_emb.weight")
        out = [r for r in rules if r.bl[0] in embed]
        layer = self.layer_rules(cfg)
        for i in range(cfg.num_blks):
            prefix = self.layer_prefix.format(i=i)
            out.extend(
                dataclasses.replace(
                    r,
                    hf=prefix + r.hf,
                    bl=tuple(f"stack.blocks.{i}.{b}" for b in r.bl),
                )
                for r in layer
            )
        out.extend(r for r in rules if r.bl[0] not in embed)
        return out


#: Registered families by short name (`register_family` adds one; every
#: module of `interop.families` registers its own when imported).
FAMILIES: dict[str, Family] = {}


def register_family(family: Family) -> Family:
    """Add `family` to `FAMILIES` (replacing one of the same name); returns it.

    Raises:
        ConfigError: `family` is not a `Family`, or another registered family
            already converts one of its classes (both named).
    """
    if not isinstance(family, Family):
        raise ConfigError(
            f"register_family: family must be a Family, got {type(family).__name__}."
        )
    for other in FAMILIES.values():
        taken = sorted(set(other.classes) & set(family.classes))
        if other.name != family.name and taken:
            raise ConfigError(
                f"register_family: the family {family.name!r} converts {taken}, "
                f"which the registered family {other.name!r} already converts; a "
                "class has one family (give it another class, or register it "
                f"under the name {other.name!r} to replace that family)."
            )
    FAMILIES[family.name] = family
    return family


def decoder_families() -> dict[str, Family]:
    """The registered families of the per-layer layout (`Family.layered`):
    those converting a `DecoderLM`."""
    return {name: f for name, f in FAMILIES.items() if f.layered}


def register_llama_layout(
    name: str,
    cls: str,
    to_config: Callable[[Any], DecoderConfig],
    hf_fields: Callable[[DecoderConfig], dict[str, Any]],
    layer_rules: Callable[[DecoderConfig], list[Rule]],
    fields: Mapping[str, Any],
    **options: Any,
) -> Family:
    """Register the family `name` of the model class `cls` with the state-dict
    layout of Llama and the families built on its code: layer `i`'s keys under
    `model.layers.{i}.`, then `model_global_rules`. `options`: the other
    `Family` fields. Returns the family."""
    return register_family(
        Family(
            name=name,
            classes=(cls,),
            to_config=to_config,
            hf_fields=hf_fields,
            layer_prefix="model.layers.{i}.",
            layer_rules=layer_rules,
            global_rules=model_global_rules,
            fields=fields,
            **options,
        )
    )


def _class_names(families: Mapping[str, Family] | None = None) -> list[str]:
    families = FAMILIES if families is None else families
    return sorted(c for f in families.values() for c in f.classes)


def family_for_class(name: str) -> Family:
    """The family converting the `transformers` model class `name`."""
    for family in FAMILIES.values():
        if name in family.classes:
            return family
    raise ConfigError(
        f"from_huggingface: the model class {name} is not supported; supported "
        f"classes: {_class_names()} (register others with "
        "blocklab.interop.register_family)."
    )


# Expressibility ----------------------------------------------------------------

#: Fields of a `DecoderConfig` subclass that choose an implementation, not the
#: numbers (`MoEDecoderConfig.dispatch`: dense and sorted give the same logits).
IMPLEMENTATION_FIELDS = frozenset({"dispatch"})
_BASE_FIELDS = frozenset(f.name for f in dataclasses.fields(DecoderConfig))


def forward_settings(cfg: DecoderConfig) -> dict[str, Any]:
    """The settings of `cfg` that determine its forward pass, defaults resolved.

    Two configs with equal settings build models of the same structure that
    compute the same function of the same weights: `num_kv_heads=None` and
    `num_kv_heads=num_heads` are one setting, as are `attn_scale=None` and
    $p^{-1/2}$; windows and RoPE bases are compared per layer. A subclass's
    own fields (e.g. `num_experts`) count, under the class name.
    """
    out: dict[str, Any] = {"config class": type(cfg).__name__}
    for name in ("vocab_size", "num_hiddens", "num_heads", "num_blks"):
        out[name] = getattr(cfg, name)
    out["num_kv_heads"] = cfg.block.num_kv_heads
    out["head_dim"] = cfg.block.head_dim
    out["ffn_width"] = (
        ffn_width(cfg.num_hiddens, cfg.act) if cfg.ffn_width is None else cfg.ffn_width
    )
    for name in ("act", "norm", "norm_eps", "placement", "attn_bias", "ffn_bias"):
        out[name] = getattr(cfg, name)
    out["qk_norm"] = "head" if cfg.qk_norm is True else cfg.qk_norm
    out["positions"] = cfg.positions
    out["max_len"] = cfg.max_len
    out["rope_theta/local_rope_theta (per layer)"] = cfg.layer_thetas()
    out["window/global_layers (per-layer window, 0 = global)"] = cfg.layer_windows()
    out["attn_scale"] = (
        cfg.block.head_dim**-0.5 if cfg.attn_scale is None else cfg.attn_scale
    )
    out["embed_scale"] = 1.0 if cfg.embed_scale is None else cfg.embed_scale
    out["tie_embeddings"] = cfg.tie_embeddings
    out["attn_out_bias"] = cfg.block.attn_out_bias
    out["final_softcap"] = cfg.final_softcap
    out["attn_softcap"] = cfg.attn_softcap
    out["readout multiplier (muP d0/d)"] = cfg.readout_multiplier
    for f in dataclasses.fields(cfg):
        if f.name not in _BASE_FIELDS and f.name not in IMPLEMENTATION_FIELDS:
            out[f.name] = getattr(cfg, f.name)
    return out


def _same(a: Any, b: Any) -> bool:
    """Equal, floats to 1e-9 relative (a field written and read back)."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if (
        isinstance(a, numbers.Real)
        and isinstance(b, numbers.Real)
        and not isinstance(a, bool)
        and not isinstance(b, bool)
    ):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)
    return type(a) is type(b) and a == b


_ABSENT = "(absent)"


def unsupported_settings(cfg: DecoderConfig, family: Family) -> list[str]:
    """The settings of `cfg` that `family` cannot express (empty: it can).

    Each entry names the setting, the model's value and the value the family's
    config mapping gives (`to_config(hf_fields(cfg))`), e.g.
    `"norm='gemma_rms' (llama: 'rms')"`, or quotes the mapping's refusal.
    A family of encoders (not `Family.layered`) expresses no `DecoderConfig`.
    """
    if not family.layered:
        return [f"the {family.name} family converts {list(family.classes)}, no decoder"]
    try:
        theirs = family.to_config(types.SimpleNamespace(**family.hf_fields(cfg)))
    except ConfigError as err:
        return [f"its {family.name} config is refused: {err}"]
    ours_s, theirs_s = forward_settings(cfg), forward_settings(theirs)
    names = list(ours_s) + [k for k in theirs_s if k not in ours_s]
    return [
        f"{k}={ours_s.get(k, _ABSENT)!r} ({family.name}: {theirs_s.get(k, _ABSENT)!r})"
        for k in names
        if not _same(ours_s.get(k, _ABSENT), theirs_s.get(k, _ABSENT))
    ]


def resolve_family(
    owner: str, cfg: DecoderConfig, family: str | None, *, check: bool
) -> Family:
    """The family named by `family` (a short name or a class name), or the one
    family that can express `cfg` when `family` is None.

    Args:
        owner: the public function, for the error messages.
        cfg: the model's config.
        family: a registered short name, a class name, or None (inferred).
        check: with an explicit `family`, refuse a `cfg` it cannot express.

    Raises:
        ConfigError: an unknown `family`; a `cfg` the named family cannot
            express (with `check`), naming each setting; or, inferred, no
            family (or several) that can express `cfg`.
    """
    families = decoder_families()
    if family is not None:
        fam = families.get(family)
        if fam is None:
            fam = next((f for f in families.values() if family in f.classes), None)
        if fam is None:
            raise ConfigError(
                f"{owner}: family must be one of {sorted(families)} or the class "
                f"names {_class_names(families)}, got family={family!r}."
            )
        problems = unsupported_settings(cfg, fam) if check else []
        if problems:
            able = [
                f.name for f in families.values() if not unsupported_settings(cfg, f)
            ]
            hint = f" Families that can: {able}." if able else ""
            raise ConfigError(
                f"{owner}: family={fam.name!r} cannot express this model (the "
                "transformers model would compute other logits): "
                f"{'; '.join(problems)}.{hint}"
            )
        return fam
    reasons = {f.name: unsupported_settings(cfg, f) for f in families.values()}
    found = [name for name, why in reasons.items() if not why]
    # a variant (Mistral) yields to the family it generalizes (Llama)
    found = [n for n in found if families[n].variant_of not in found]
    if len(found) == 1:
        return families[found[0]]
    if found:
        raise ConfigError(
            f"{owner}: several Hugging Face families express this DecoderConfig "
            f"({found}); pass family= one of them."
        )
    why = "; ".join(f"{name}: {', '.join(r[:3])}" for name, r in reasons.items())
    raise ConfigError(
        f"{owner}: no registered Hugging Face family expresses this DecoderConfig "
        f"({why}); change those settings or register a family for it."
    )


# Config helpers ------------------------------------------------------------------


def refuse(cls: str, field: str, value: Any, why: str) -> ConfigError:
    """The error for an unsupported `transformers` config field of class `cls`."""
    return ConfigError(
        f"from_huggingface: {cls} config field {field}={value!r} is not supported "
        f"({why}); converting it would give a different model."
    )


#: Config fields of every `transformers` model that never change the logits:
#: names, token ids (`pad_token_id` only pins an embedding row's gradient),
#: the load dtype, output and cache switches, initialization.
HARMLESS_FIELDS = frozenset(
    {
        "_name_or_path", "_commit_hash", "architectures", "model_type",
        "transformers_version", "dtype", "torch_dtype", "_attn_implementation",
        "attn_implementation", "bos_token_id", "eos_token_id", "pad_token_id",
        "sep_token_id", "decoder_start_token_id", "id2label", "label2id",
        "num_labels", "problem_type", "finetuning_task", "tokenizer_class",
        "prefix", "task_specific_params", "output_attentions",
        "output_hidden_states", "return_dict", "use_cache", "initializer_range",
        "chunk_size_feed_forward", "is_encoder_decoder", "auto_map",
        "cache_implementation",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Derived:
    """A `transformers` default computed from the other fields: `fn(fields)`
    (a `SimpleNamespace` of the fields read so far) gives it."""

    fn: Callable[[Any], Any]


def config_fields(hf_config: Any) -> dict[str, Any]:
    """Every field of a `transformers` config (`to_dict()`), of a mapping (a
    parsed `config.json`) or of any attribute holder (`vars`)."""
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    to_dict = getattr(hf_config, "to_dict", None)
    if callable(to_dict):
        return dict(to_dict())
    return dict(vars(hf_config))


def understood(cls: str, hf_config: Any, fields: Mapping[str, Any]) -> Any:
    """The config with every field checked against what blocklab understands.

    A field is understood when it is in `fields` (the family's: mapped, or
    refused by the family's mapping at any value but its default) or in
    `HARMLESS_FIELDS`. Any other field (a new `transformers` option, a typo)
    whose value is not `None` or `False` (how an option is off) is refused,
    naming it and its value: refusal by listing what *is* understood, so an
    option blocklab does not know can never be silently dropped.

    Returns a `SimpleNamespace` of every field in `fields`: the config's
    value, else the `transformers` default (so a `config.json`, which stores
    only the fields that differ from the defaults, reads as the full config).
    The legacy top-level `rope_theta` and `rope_scaling` are folded into
    `rope_parameters` as `transformers` folds them (`rope_scaling` replaces
    it; `rope_theta` fills a missing base).

    Raises:
        ConfigError: a field not understood, named with its value.
    """
    given = config_fields(hf_config)
    # (a family with per-layer-type parameters folds its legacy keys itself)
    flat = "rope_theta" in fields.get("rope_parameters", {})
    legacy = ("rope_theta", "rope_scaling") if flat else ()
    for name, value in given.items():
        if name in fields or name in HARMLESS_FIELDS or name in legacy:
            continue
        if value is None or value is False:
            continue
        raise refuse(
            cls,
            name,
            value,
            "blocklab converts only the config fields it understands (the "
            "family's Family.fields and hf_common.HARMLESS_FIELDS); this one "
            "could change the model",
        )
    out = types.SimpleNamespace()
    derived = []
    for name, default in fields.items():
        if name in given:
            setattr(out, name, given[name])
        elif isinstance(default, Derived):
            derived.append((name, default))
        else:
            setattr(out, name, default)
    for name, default in derived:
        setattr(out, name, default.fn(out))
    if legacy and any(k in given for k in ("rope_scaling", "rope_theta")):
        # transformers' convert_rope_params_to_dict: rope_scaling replaces
        # rope_parameters; a top-level rope_theta fills a missing base
        params = given.get("rope_scaling") or given.get("rope_parameters") or {}
        if isinstance(params, Mapping):
            default = fields["rope_parameters"].get("rope_theta", 10000.0)
            params = legacy_rope(params, given.get("rope_theta"), default)
        out.rope_parameters = params
    return out


def get_field(hf_config: Any, field: str, default: Any = None) -> Any:
    """A `transformers` config field, `default` when the config has none."""
    return getattr(hf_config, field, default)


def eval_config(hf_model: Any, cls: str, dropout_fields: Sequence[str]) -> Any:
    """The config of `hf_model` (of class `cls`); refuses a model without one,
    or in training mode with a dropout rate of `dropout_fields` above 0."""
    hf_config = getattr(hf_model, "config", None)
    if hf_config is None:
        raise ConfigError(f"from_huggingface: the {cls} has no config attribute.")
    if getattr(hf_model, "training", False):
        for field in dropout_fields:
            rate = get_field(hf_config, field, 0.0) or 0.0
            if rate > 0:
                raise refuse(
                    cls,
                    field,
                    rate,
                    "the model is in training mode, so dropout is active; call "
                    "hf_model.eval() first",
                )
    return hf_config


def require(cls: str, hf_config: Any, field: str, allowed: Sequence[Any], why: str):
    """The field's value if it is one of `allowed`, else `refuse`."""
    value = get_field(hf_config, field)
    if value not in allowed:
        raise refuse(cls, field, value, why)
    return value


def rope_theta(cls: str, params: Any, field: str) -> float:
    """The base of a default-type rope parameter dict; refuse any other type."""
    if params is None:
        return 10000.0
    if not isinstance(params, Mapping):
        raise refuse(cls, field, params, "expected a dict of rope parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise refuse(
            cls,
            f"{field}['rope_type']",
            rope_type,
            "blocklab implements the default (unscaled) RoPE only",
        )
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise refuse(
            cls,
            f"{field}['partial_rotary_factor']",
            factor,
            "blocklab rotates every feature of each head",
        )
    extra = sorted(
        set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    if extra:
        raise refuse(
            cls, f"{field}['{extra[0]}']", params[extra[0]], "a rope scaling setting"
        )
    return float(params.get("rope_theta", 10000.0))


def rope_fields(theta: float | None) -> dict[str, Any]:
    """Default-type rope parameters of base `theta` (the inverse of `rope_theta`)."""
    return {"rope_type": "default", "rope_theta": 10000.0 if theta is None else theta}


def legacy_rope(scaling: Any, theta: Any, default: float) -> dict[str, Any]:
    """One rope parameter dict from the legacy keys, as `transformers` folds
    them: `scaling` (`rope_scaling`; its `type` read as `rope_type`, default
    `"default"`) with the base `theta` (`rope_theta`; `None`: `default`) where
    it names none."""
    params = dict(scaling or {})
    if "type" in params:
        params.setdefault("rope_type", params.pop("type"))
    params.setdefault("rope_type", "default")
    params.setdefault("rope_theta", default if theta is None else theta)
    return params


#: The entries of a `layer_types` list: a global layer, a sliding-window one.
LAYER_TYPES = ("full_attention", "sliding_attention")


def global_layers_of(cls: str, hf: Any) -> tuple[int, ...] | None:
    """The layers `hf.layer_types` marks global; `None` when it marks none
    sliding. Refuses a list that is not one of `LAYER_TYPES` per layer."""
    types = list(hf.layer_types)
    if len(types) != hf.num_hidden_layers:
        raise refuse(
            cls, "layer_types", types, f"expected {hf.num_hidden_layers} entries"
        )
    unknown = sorted(set(types) - set(LAYER_TYPES))
    if unknown:
        raise refuse(
            cls, "layer_types", unknown[0], f"layer types must be one of {LAYER_TYPES}"
        )
    if LAYER_TYPES[1] not in types:
        return None
    return tuple(i for i, t in enumerate(types) if t == LAYER_TYPES[0])


def layer_types_of(cfg: DecoderConfig) -> list[str]:
    """The `layer_types` of `cfg` (the inverse of `global_layers_of`)."""
    return [
        LAYER_TYPES[0] if cfg.is_global(i) else LAYER_TYPES[1]
        for i in range(cfg.num_blks)
    ]


#: `transformers` activation name -> blocklab's gated FFN activation
#: (`blocklab.nn.config.GATED_ACTS` lists the gated activations themselves).
HF_ACT_TO_GATED = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "relu": "reglu",
}
_HF_GATED = {"swiglu": "silu", "geglu": "gelu_pytorch_tanh", "reglu": "relu"}


def gated_act(cls: str, hf_config: Any, field: str) -> str:
    """blocklab's gated activation for the config's `field`, or `refuse`."""
    act = get_field(hf_config, field)
    if act not in HF_ACT_TO_GATED:
        raise refuse(
            cls,
            field,
            act,
            f"supported activations: {sorted(HF_ACT_TO_GATED)} (gated FFN)",
        )
    return HF_ACT_TO_GATED[act]


def hf_gated_act(act: str) -> str:
    """The `transformers` name of a gated activation; an ungated `act` has none
    and maps to SwiGLU's, so that `unsupported_settings` names `act`."""
    return _HF_GATED.get(act, "silu")


def no_softcapping(cls: str, hf_config: Any) -> None:
    """Refuse attention or final logit softcapping."""
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = get_field(hf_config, field)
        if value is not None:
            raise refuse(cls, field, value, "blocklab has no logit softcapping")


def decoder_config(
    hf: Any, cls: str, preset: Callable, *, act_field: str = "hidden_act", **extra: Any
) -> DecoderConfig:
    """The config built by `preset` (e.g. `DecoderConfig.llama`) from the fields
    every family here but GPT-2 names alike: sizes, grouped-query heads,
    context, gated activation (the field `act_field`), RMSNorm eps, MLP width,
    attention bias and tied head; `extra`: the family's own fields (they win)."""
    fields = dict(
        num_kv_heads=get_field(hf, "num_key_value_heads") or hf.num_attention_heads,
        max_len=hf.max_position_embeddings,
        act=gated_act(cls, hf, act_field),
        norm_eps=float(hf.rms_norm_eps),
        ffn_width=hf.intermediate_size,
        attn_bias=bool(get_field(hf, "attention_bias", False)),
        tie_embeddings=bool(get_field(hf, "tie_word_embeddings", False)),
    )
    fields.update(extra)
    return preset(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        **fields,
    )


def decoder_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `transformers` fields `decoder_config` reads, for `cfg` (without the
    activation, whose field name differs, and `attention_bias`, which not
    every family has)."""
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.num_hiddens,
        num_attention_heads=cfg.num_heads,
        num_hidden_layers=cfg.num_blks,
        num_key_value_heads=cfg.block.num_kv_heads,
        max_position_embeddings=cfg.max_len,
        rms_norm_eps=cfg.norm_eps,
        intermediate_size=forward_settings(cfg)["ffn_width"],
        tie_word_embeddings=cfg.tie_embeddings,
    )


def llama_like(hf: Any, cls: str, preset: Callable, **extra: Any) -> DecoderConfig:
    """The config of a Llama-shaped model (Llama, Mistral, Qwen 2, Qwen 3,
    OLMo 2, Phi-3, Mixtral) built by `preset` (e.g. `DecoderConfig.llama`):
    `decoder_config` with one default-type RoPE base, and the family's `extra`
    fields."""
    theta = rope_theta(cls, get_field(hf, "rope_parameters"), "rope_parameters")
    legacy = get_field(hf, "rope_scaling")  # 5.x: an alias of rope_parameters
    if legacy is not None and legacy != get_field(hf, "rope_parameters"):
        theta = rope_theta(cls, legacy, "rope_scaling")
    return decoder_config(hf, cls, preset, **{"rope_theta": theta, **extra})


def llama_like_fields(cfg: DecoderConfig) -> dict[str, Any]:
    """The `transformers` fields `llama_like` reads, for `cfg` (without
    `attention_bias`, which not every Llama-shaped config has)."""
    return dict(
        decoder_fields(cfg),
        hidden_act=hf_gated_act(cfg.act),
        rope_parameters=rope_fields(cfg.rope_theta),
    )


#: BERT / ViT `hidden_act` -> blocklab's `act` (their `"gelu"` is the exact
#: erf GELU, `"gelu_new"` the tanh one), and blocklab's `act` -> `hidden_act`.
BERT_ACTS = {"gelu": "gelu_exact", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu",
             "relu": "relu"}  # fmt: skip
HF_BERT_ACTS = {"gelu_exact": "gelu", "gelu": "gelu_new", "relu": "relu"}


def label_fields(num_labels: int) -> dict[str, dict]:
    """`id2label` and `label2id` of a classifier of `num_labels` classes
    (`transformers`' default names `LABEL_i`)."""
    return {
        "id2label": {str(i): f"LABEL_{i}" for i in range(num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(num_labels)},
    }


def stack_rules(
    num_blks: int, hf_prefix: str, layer: Sequence[tuple[str, str, bool]]
) -> list[Rule]:
    """The absolute `Rule`s of a stack's layers: for layer $i$ and each `(hf,
    ours, biased)` of `layer`, `{hf_prefix}{i}.{hf}.weight` holds
    `stack.blocks.{i}.{ours}.weight` (and `.bias` the bias when `biased`)."""
    return [
        Rule(f"{hf_prefix}{i}.{hf}.{n}", (f"stack.blocks.{i}.{ours}.{n}",))
        for i in range(num_blks)
        for hf, ours, biased in layer
        for n in (("weight", "bias") if biased else ("weight",))
    ]
