r"""Convert Hugging Face `transformers` decoder models to and from `DecoderLM`.

`from_huggingface(hf_model)` reads a PyTorch `GPT2LMHeadModel`,
`LlamaForCausalLM`, `Olmo2ForCausalLM` or `Gemma3ForCausalLM` (text) with its
config and returns a `blocklab.DecoderLM` whose logits equal the PyTorch
model's (float32). `to_huggingface_state_dict(model)` is the inverse: a
`{name: numpy array}` dict in the `transformers` names and layouts, which
`load_huggingface_state_dict` (or `hf_model.load_state_dict` after
`torch.from_numpy`) reads back bit for bit.

Each family is an `HFFamily` in the registry `FAMILIES`: a function from the
Hugging Face config to a `DecoderConfig`, which refuses (`ConfigError`,
naming the field and its value) every setting that would change the maths and
that blocklab does not implement, and the list of `Rule`s mapping state-dict
keys onto blocklab parameters. `register_family` adds one (e.g. a mixture of
experts) without touching this module.

Layouts: `nn.Linear` stores `(out, in)`, as `equinox.nn.Linear` does, so those
weights copy as they are; GPT-2's `Conv1D` stores `(in, out)` (transposed) and
fuses the query, key and value projections column-wise in `c_attn`. Gemma's
RMSNorm gain is $1 + w$ with $w$ stored; blocklab's `"gemma_rms"` norm stores
the same $w$. `torch` is imported only inside the functions that need it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import equinox as eqx
import jax
import numpy as np

from .._validate import ConfigError
from ..nn.decoder import DecoderConfig, DecoderLM, _set_layer_data
from .porting import _check_keys, _shapes, load_state_dict, state_dict

__all__ = [
    "FAMILIES",
    "HFFamily",
    "Rule",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "register_family",
    "to_huggingface_state_dict",
]


# State-dict rules ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """One Hugging Face key and the blocklab parameter(s) it holds.

    Attributes:
        hf: the `transformers` key (per-layer rules: relative to the layer
            prefix, e.g. `"self_attn.q_proj.weight"`).
        bl: the blocklab names (per-layer rules: relative to the block,
            e.g. `("attention.W_q.weight",)`).
        kind: `"same"` (copied), `"T"` (transposed), `"cat_T"` (the
            transposed arrays concatenated along columns: GPT-2's fused
            `c_attn.weight`), `"cat"` (concatenated: its fused bias) or `"cat1"`
            (concatenated along axis 1: Mixtral's fused expert `gate_up_proj`).
    """

    hf: str
    bl: tuple[str, ...]
    kind: str = "same"


def _to_hf(kind: str, arrays: Sequence[np.ndarray]) -> np.ndarray:
    if kind == "same":
        return arrays[0]
    if kind == "T":
        return np.ascontiguousarray(arrays[0].T)
    if kind == "cat_T":
        return np.concatenate([a.T for a in arrays], axis=1)
    if kind == "cat":
        return np.concatenate(arrays, axis=0)
    if kind == "cat1":
        return np.concatenate(arrays, axis=1)
    raise ValueError(f"unknown rule kind {kind!r}")


def _from_hf(kind: str, array: np.ndarray, n: int) -> list[np.ndarray]:
    if kind == "same":
        return [array]
    if kind == "T":
        return [np.ascontiguousarray(array.T)]
    if kind == "cat_T":
        return [np.ascontiguousarray(a.T) for a in np.split(array, n, axis=1)]
    if kind == "cat":
        return list(np.split(array, n, axis=0))
    if kind == "cat1":
        return [np.ascontiguousarray(a) for a in np.split(array, n, axis=1)]
    raise ValueError(f"unknown rule kind {kind!r}")


def _hf_shape(kind: str, shapes: Sequence[tuple[int, ...]]) -> tuple[int, ...]:
    if kind == "same":
        return shapes[0]
    if kind == "T":
        return shapes[0][::-1]
    if kind == "cat_T":
        return (shapes[0][1], sum(s[0] for s in shapes))
    if kind == "cat":
        return (sum(s[0] for s in shapes),)
    if kind == "cat1":
        return (shapes[0][0], sum(s[1] for s in shapes), *shapes[0][2:])
    raise ValueError(f"unknown rule kind {kind!r}")


@dataclasses.dataclass(frozen=True)
class HFFamily:
    """How one `transformers` model family maps onto `DecoderLM`.

    Attributes:
        name: short name (`"llama"`), accepted as `family=` by
            `to_huggingface_state_dict` / `load_huggingface_state_dict`.
        classes: the `transformers` model class names it converts.
        to_config: `to_config(hf_config) -> DecoderConfig`; raises
            `ConfigError` naming any unsupported field and its value.
        layer_prefix: the prefix of layer `i`'s keys, with `{i}`.
        layer_rules: `layer_rules(cfg)` -> the `Rule`s of one layer.
        global_rules: `global_rules(cfg)` -> the `Rule`s outside the layers
            (embeddings, final norm, untied head), with absolute names.
        matches: `matches(cfg)`: whether a blocklab config has this family's
            structure (used to infer the family of a model).
        dropout_fields: config fields holding dropout rates, refused while
            the PyTorch model is in training mode.
    """

    name: str
    classes: tuple[str, ...]
    to_config: Callable[[Any], DecoderConfig]
    layer_prefix: str
    layer_rules: Callable[[DecoderConfig], list[Rule]]
    global_rules: Callable[[DecoderConfig], list[Rule]]
    matches: Callable[[DecoderConfig], bool]
    dropout_fields: tuple[str, ...] = ("attention_dropout",)


#: Registered families by short name (`register_family` adds one).
FAMILIES: dict[str, HFFamily] = {}


def register_family(family: HFFamily) -> HFFamily:
    """Add `family` to `FAMILIES` (replacing one of the same name); returns it."""
    if not isinstance(family, HFFamily):
        raise ConfigError(
            f"register_family: expected an HFFamily, got {type(family).__name__}."
        )
    FAMILIES[family.name] = family
    return family


def _family_for_class(name: str) -> HFFamily:
    for family in FAMILIES.values():
        if name in family.classes:
            return family
    supported = sorted(c for f in FAMILIES.values() for c in f.classes)
    raise ConfigError(
        f"from_huggingface: the model class {name} is not supported; supported "
        f"classes: {supported} (register others with "
        "blocklab.interop.register_family)."
    )


def _family(cfg: DecoderConfig, family: str | None) -> HFFamily:
    if family is not None:
        if family in FAMILIES:
            return FAMILIES[family]
        for f in FAMILIES.values():
            if family in f.classes:
                return f
        raise ConfigError(
            f"unknown family={family!r}; registered: {sorted(FAMILIES)} or the "
            f"class names {sorted(c for f in FAMILIES.values() for c in f.classes)}."
        )
    found = [f for f in FAMILIES.values() if f.matches(cfg)]
    if len(found) != 1:
        raise ConfigError(
            "cannot tell which Hugging Face family this DecoderConfig has "
            f"(matching: {[f.name for f in found]}); pass family= one of "
            f"{sorted(FAMILIES)}."
        )
    return found[0]


# Config checks -----------------------------------------------------------------


def _refuse(cls: str, field: str, value: Any, why: str) -> ConfigError:
    return ConfigError(
        f"from_huggingface: {cls} config field {field}={value!r} is not supported "
        f"({why}); converting it would give a different model."
    )


def _get(hf_config, field: str, default: Any = None) -> Any:
    return getattr(hf_config, field, default)


def _require(cls: str, hf_config, field: str, allowed: Sequence[Any], why: str):
    value = _get(hf_config, field)
    if value not in allowed:
        raise _refuse(cls, field, value, why)
    return value


def _rope_theta(cls: str, params: Any, field: str) -> float:
    """The base of a default-type rope parameter dict; refuse any other type."""
    if params is None:
        return 10000.0
    if not isinstance(params, Mapping):
        raise _refuse(cls, field, params, "expected a dict of rope parameters")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise _refuse(
            cls,
            f"{field}['rope_type']",
            rope_type,
            "blocklab implements the default (unscaled) RoPE only",
        )
    factor = params.get("partial_rotary_factor", 1.0)
    if factor != 1.0:
        raise _refuse(
            cls,
            f"{field}['partial_rotary_factor']",
            factor,
            "blocklab rotates every feature of each head",
        )
    extra = sorted(
        set(params) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    )
    if extra:
        raise _refuse(
            cls, f"{field}['{extra[0]}']", params[extra[0]], "a rope scaling setting"
        )
    return float(params.get("rope_theta", 10000.0))


_GATED = {
    "silu": "swiglu",
    "swish": "swiglu",
    "gelu_pytorch_tanh": "geglu",
    "gelu_new": "geglu",
    "relu": "reglu",
}


def _gated_act(cls: str, hf_config, field: str) -> str:
    act = _get(hf_config, field)
    if act not in _GATED:
        raise _refuse(
            cls, field, act, f"supported activations: {sorted(_GATED)} (gated FFN)"
        )
    return _GATED[act]


def _no_softcapping(cls: str, hf_config) -> None:
    for field in ("attn_logit_softcapping", "final_logit_softcapping"):
        value = _get(hf_config, field)
        if value is not None:
            raise _refuse(cls, field, value, "blocklab has no logit softcapping")


def _gpt2_config(hf) -> DecoderConfig:
    cls = "GPT2LMHeadModel"
    acts = {
        "gelu_new": "gelu",
        "gelu_pytorch_tanh": "gelu",
        "gelu": "gelu_exact",
        "relu": "relu",
    }
    act = _get(hf, "activation_function")
    if act not in acts:
        raise _refuse(cls, "activation_function", act, f"supported: {sorted(acts)}")
    _require(
        cls,
        hf,
        "scale_attn_by_inverse_layer_idx",
        (False, None),
        "blocklab scales every layer's scores by head_dim**-0.5 alone",
    )
    _require(
        cls, hf, "scale_attn_weights", (True,), "blocklab always scales the scores"
    )
    _require(
        cls,
        hf,
        "add_cross_attention",
        (False, None),
        "a decoder has no cross-attention",
    )
    return DecoderConfig.gpt2(
        hf.vocab_size,
        hf.n_embd,
        hf.n_head,
        hf.n_layer,
        max_len=hf.n_positions,
        act=acts[act],
        norm_eps=float(hf.layer_norm_epsilon),
        ffn_width=hf.n_inner,
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", True)),
    )


def _llama_like(hf, cls: str, preset, **extra) -> DecoderConfig:
    theta = _rope_theta(cls, _get(hf, "rope_parameters"), "rope_parameters")
    legacy = _get(hf, "rope_scaling")  # 5.x: an alias of rope_parameters
    if legacy is not None and legacy != _get(hf, "rope_parameters"):
        theta = _rope_theta(cls, legacy, "rope_scaling")
    act = _gated_act(cls, hf, "hidden_act")
    return preset(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        num_kv_heads=_get(hf, "num_key_value_heads") or hf.num_attention_heads,
        max_len=hf.max_position_embeddings,
        act=act,
        norm_eps=float(hf.rms_norm_eps),
        ffn_width=hf.intermediate_size,
        rope_theta=theta,
        attn_bias=bool(_get(hf, "attention_bias", False)),
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", False)),
        **extra,
    )


def _llama_config(hf) -> DecoderConfig:
    return _llama_like(
        hf,
        "LlamaForCausalLM",
        DecoderConfig.llama,
        head_dim=_get(hf, "head_dim"),
        ffn_bias=bool(_get(hf, "mlp_bias", False)),
    )


def _olmo2_config(hf) -> DecoderConfig:
    return _llama_like(hf, "Olmo2ForCausalLM", DecoderConfig.olmo2)


def _gemma3_config(hf) -> DecoderConfig:
    cls = "Gemma3ForCausalLM"
    if _get(hf, "text_config") is not None:
        raise _refuse(
            cls, "text_config", "...", "convert the text model (Gemma3TextConfig) only"
        )
    _no_softcapping(cls, hf)
    _require(
        cls,
        hf,
        "use_bidirectional_attention",
        (False, None),
        "blocklab's decoder is causal",
    )
    params = _get(hf, "rope_parameters") or {}
    if not isinstance(params, Mapping) or not {
        "full_attention",
        "sliding_attention",
    } >= set(params):
        raise _refuse(
            cls,
            "rope_parameters",
            params,
            "expected per-layer-type rope parameters",
        )
    theta_full = _rope_theta(
        cls, params.get("full_attention"), "rope_parameters['full_attention']"
    )
    theta_local = _rope_theta(
        cls, params.get("sliding_attention"), "rope_parameters['sliding_attention']"
    )
    types = list(_get(hf, "layer_types"))
    unknown = sorted({t for t in types} - {"full_attention", "sliding_attention"})
    if unknown:
        raise _refuse(
            cls,
            "layer_types",
            unknown[0],
            "layer types must be full_attention or sliding_attention",
        )
    if len(types) != hf.num_hidden_layers:
        raise _refuse(
            cls, "layer_types", types, f"expected {hf.num_hidden_layers} entries"
        )
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    window = _get(hf, "sliding_window") if sliding else None
    if sliding and window is None:
        raise _refuse(cls, "sliding_window", None, "sliding layers need a window")
    act = _gated_act(cls, hf, "hidden_activation")
    if sliding:
        layers = dict(
            window=window,
            global_layers=tuple(
                i for i, t in enumerate(types) if t == "full_attention"
            ),
            local_rope_theta=theta_local,
        )
    else:
        layers = dict(window=None, global_layers=None, local_rope_theta=None)
    return DecoderConfig.gemma3(
        hf.vocab_size,
        hf.hidden_size,
        hf.num_attention_heads,
        hf.num_hidden_layers,
        num_kv_heads=_get(hf, "num_key_value_heads") or hf.num_attention_heads,
        head_dim=hf.head_dim,
        query_pre_attn_scalar=float(hf.query_pre_attn_scalar),
        max_len=hf.max_position_embeddings,
        act=act,
        norm_eps=float(hf.rms_norm_eps),
        ffn_width=hf.intermediate_size,
        attn_bias=bool(_get(hf, "attention_bias", False)),
        rope_theta=theta_full,
        tie_embeddings=bool(_get(hf, "tie_word_embeddings", True)),
        **layers,
    )


def _biased(rules: list[Rule], flag: bool, kind: str = "same") -> list[Rule]:
    """Add the bias rule after each weight rule when `flag` (same layout kind)."""
    if not flag:
        return rules
    out = []
    for r in rules:
        out.append(r)
        bias_kind = "cat" if r.kind == "cat_T" else "same"
        out.append(
            Rule(
                r.hf.replace(".weight", ".bias"),
                tuple(b.replace(".weight", ".bias") for b in r.bl),
                bias_kind,
            )
        )
    return out


def _gpt2_layer(cfg: DecoderConfig) -> list[Rule]:
    att = "attention."
    return [
        Rule("ln_1.weight", ("norm1.weight",)),
        Rule("ln_1.bias", ("norm1.bias",)),
        *_biased(
            [
                Rule(
                    "attn.c_attn.weight",
                    (att + "W_q.weight", att + "W_k.weight", att + "W_v.weight"),
                    "cat_T",
                ),
                Rule("attn.c_proj.weight", (att + "W_o.weight",), "T"),
            ],
            cfg.attn_bias,
        ),
        Rule("ln_2.weight", ("norm2.weight",)),
        Rule("ln_2.bias", ("norm2.bias",)),
        *_biased(
            [
                Rule("mlp.c_fc.weight", ("ffn.W_1.weight",), "T"),
                Rule("mlp.c_proj.weight", ("ffn.W_2.weight",), "T"),
            ],
            cfg.ffn_bias,
        ),
    ]


def _gpt2_global(cfg: DecoderConfig) -> list[Rule]:
    rules = [
        Rule("transformer.wte.weight", ("token_emb.weight",)),
        Rule("transformer.wpe.weight", ("pos_emb.weight",)),
        Rule("transformer.ln_f.weight", ("norm.weight",)),
        Rule("transformer.ln_f.bias", ("norm.bias",)),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("head.weight",)))
    return rules


def _attn_rules(cfg: DecoderConfig) -> list[Rule]:
    return _biased(
        [
            Rule(f"self_attn.{n}_proj.weight", (f"attention.W_{n}.weight",))
            for n in "qkvo"
        ],
        cfg.attn_bias,
    )


def _mlp_rules(cfg: DecoderConfig) -> list[Rule]:
    return _biased(
        [
            Rule("mlp.gate_proj.weight", ("ffn.W_g.weight",)),
            Rule("mlp.up_proj.weight", ("ffn.W_1.weight",)),
            Rule("mlp.down_proj.weight", ("ffn.W_2.weight",)),
        ],
        cfg.ffn_bias,
    )


def _qk_norm_rules(cfg: DecoderConfig) -> list[Rule]:
    if cfg.qk_norm is False:
        return []
    return [
        Rule("self_attn.q_norm.weight", ("attention.q_norm.weight",)),
        Rule("self_attn.k_norm.weight", ("attention.k_norm.weight",)),
    ]


def _llama_layer(cfg: DecoderConfig) -> list[Rule]:
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *_attn_rules(cfg),
        *_qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("norm2.weight",)),
        *_mlp_rules(cfg),
    ]


def _olmo2_layer(cfg: DecoderConfig) -> list[Rule]:
    # "output" placement: norm1 / norm2 normalize what each branch writes.
    return [
        *_attn_rules(cfg),
        *_qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("norm1.weight",)),
        *_mlp_rules(cfg),
        Rule("post_feedforward_layernorm.weight", ("norm2.weight",)),
    ]


def _gemma3_layer(cfg: DecoderConfig) -> list[Rule]:
    return [
        Rule("input_layernorm.weight", ("norm1.weight",)),
        *_attn_rules(cfg),
        *_qk_norm_rules(cfg),
        Rule("post_attention_layernorm.weight", ("out_norm1.weight",)),
        Rule("pre_feedforward_layernorm.weight", ("norm2.weight",)),
        *_mlp_rules(cfg),
        Rule("post_feedforward_layernorm.weight", ("out_norm2.weight",)),
    ]


def _model_global(cfg: DecoderConfig) -> list[Rule]:
    rules = [
        Rule("model.embed_tokens.weight", ("token_emb.weight",)),
        Rule("model.norm.weight", ("norm.weight",)),
    ]
    if not cfg.tie_embeddings:
        rules.append(Rule("lm_head.weight", ("head.weight",)))
    return rules


register_family(
    HFFamily(
        name="gpt2",
        classes=("GPT2LMHeadModel",),
        to_config=_gpt2_config,
        layer_prefix="transformer.h.{i}.",
        layer_rules=_gpt2_layer,
        global_rules=_gpt2_global,
        matches=lambda c: c.positions == "learned" and c.norm == "layer",
        dropout_fields=("attn_pdrop", "resid_pdrop", "embd_pdrop"),
    )
)
register_family(
    HFFamily(
        name="llama",
        classes=("LlamaForCausalLM",),
        to_config=_llama_config,
        layer_prefix="model.layers.{i}.",
        layer_rules=_llama_layer,
        global_rules=_model_global,
        matches=lambda c: (
            c.positions == "rope"
            and c.placement == "pre"
            and c.norm == "rms"
            and c.qk_norm is False
        ),
    )
)
register_family(
    HFFamily(
        name="olmo2",
        classes=("Olmo2ForCausalLM",),
        to_config=_olmo2_config,
        layer_prefix="model.layers.{i}.",
        layer_rules=_olmo2_layer,
        global_rules=_model_global,
        matches=lambda c: (
            c.positions == "rope" and c.placement == "output" and c.qk_norm == "full"
        ),
    )
)
register_family(
    HFFamily(
        name="gemma3",
        classes=("Gemma3ForCausalLM",),
        to_config=_gemma3_config,
        layer_prefix="model.layers.{i}.",
        layer_rules=_gemma3_layer,
        global_rules=_model_global,
        matches=lambda c: (
            c.positions == "rope"
            and c.placement == "sandwich"
            and c.norm == "gemma_rms"
        ),
    )
)


# Conversion ----------------------------------------------------------------------


def _all_rules(
    cfg: DecoderConfig, fam: HFFamily
) -> list[tuple[str, tuple[str, ...], str]]:
    """(hf key, blocklab names, kind) for every key: embeddings, layers, the rest."""
    rules = fam.global_rules(cfg)
    embed = ("token_emb.weight", "pos_emb.weight")
    out = [(r.hf, r.bl, r.kind) for r in rules if r.bl[0] in embed]
    layer = fam.layer_rules(cfg)
    for i in range(cfg.num_blks):
        prefix = fam.layer_prefix.format(i=i)
        out.extend(
            (prefix + r.hf, tuple(f"stack.blocks.{i}.{b}" for b in r.bl), r.kind)
            for r in layer
        )
    out.extend((r.hf, r.bl, r.kind) for r in rules if r.bl[0] not in embed)
    return out


def hf_config_to_decoder(hf_config: Any, class_name: str) -> DecoderConfig:
    """The `DecoderConfig` of a `transformers` config for the model class `class_name`.

    Raises:
        ConfigError: an unsupported class, or a config field (named, with its
            value) that blocklab does not implement.
    """
    return _family_for_class(class_name).to_config(hf_config)


def to_huggingface_state_dict(
    model: DecoderLM, *, family: str | None = None
) -> dict[str, np.ndarray]:
    """The `transformers` state dict of `model`: `{key: numpy array}`.

    Keys and layouts are those of the family's PyTorch model (`Conv1D`
    transposed and `c_attn` fused for GPT-2); a tied head has no
    `lm_head.weight` (as `save_pretrained` writes it). Load it into a PyTorch
    model with `hf_model.load_state_dict({k: torch.from_numpy(v) ...},
    strict=False)`, or back into blocklab with `load_huggingface_state_dict`
    (bit for bit).

    Args:
        model: a `DecoderLM`.
        family: `"gpt2"`, `"llama"`, `"olmo2"`, `"gemma3"` (or a class name);
            `None` infers it from the model's config.
    """
    if not isinstance(model, DecoderLM):
        raise ConfigError(
            f"to_huggingface_state_dict: expected a DecoderLM, got "
            f"{type(model).__name__}."
        )
    fam = _family(model.cfg, family)
    ours = state_dict(model)
    return {
        hf: _to_hf(kind, [ours[b] for b in bl])
        for hf, bl, kind in _all_rules(model.cfg, fam)
    }


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
    model_or_config: DecoderLM | DecoderConfig,
    hf_state_dict: Mapping[str, Any],
    *,
    family: str | None = None,
) -> DecoderLM:
    """A `DecoderLM` with every weight taken from a `transformers` state dict.

    Args:
        model_or_config: a `DecoderLM` (its structure is kept, its weights
            replaced) or a `DecoderConfig` (a model is built for it).
        hf_state_dict: `{key: array or torch tensor}` in the family's names
            and layouts. For a tied head, `lm_head.weight` may be present and
            must equal the token embedding exactly.
        family: as for `to_huggingface_state_dict`.

    Raises:
        ConfigError: a missing key, an unexpected key or a wrong shape
            (naming the key, and both shapes), or an `lm_head.weight` that
            differs from the tied embedding.
    """
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
    fam = _family(cfg, family)
    rules = _all_rules(cfg, fam)
    ours_shapes = _shapes(model)
    expected = {
        hf: _hf_shape(kind, [ours_shapes[b] for b in bl]) for hf, bl, kind in rules
    }
    given = dict(hf_state_dict)
    tied_head = None
    if (
        cfg.tie_embeddings
        and "lm_head.weight" in given
        and "lm_head.weight" not in expected
    ):
        tied_head = _to_numpy(given.pop("lm_head.weight"))
    _check_keys(
        "load_huggingface_state_dict",
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
    for hf, bl, kind in rules:
        for name, value in zip(bl, _from_hf(kind, arrays[hf], len(bl)), strict=True):
            ours[name] = value
    model = load_state_dict(model, ours)
    if isinstance(model_or_config, DecoderConfig):
        model = eqx.tree_at(lambda m: m.stack, model, _set_layer_data(model.stack, cfg))
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


def from_huggingface(hf_model: Any) -> DecoderLM:
    """Convert a `transformers` PyTorch causal LM into a `DecoderLM`.

    Supported: `GPT2LMHeadModel`, `LlamaForCausalLM`, `Olmo2ForCausalLM`,
    `Gemma3ForCausalLM` (text), and any class added with `register_family`.
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
    fam = _family_for_class(cls)
    hf_config = getattr(hf_model, "config", None)
    if hf_config is None:
        raise ConfigError(f"from_huggingface: the {cls} has no config attribute.")
    if getattr(hf_model, "training", False):
        for field in fam.dropout_fields:
            rate = _get(hf_config, field, 0.0) or 0.0
            if rate > 0:
                raise _refuse(
                    cls,
                    field,
                    rate,
                    "the model is in training mode, so dropout is active; call "
                    "hf_model.eval() first",
                )
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
