"""Every `transformers` config field of the nine families is understood: mapped,
known to be harmless, or refused by name (issue 20 item 4).

The families refuse by listing what they understand (`Family.fields`, plus
`hf_common.HARMLESS_FIELDS`), so a field that `transformers` adds tomorrow is
refused until someone reads it. Here each family's config is built with every
field `transformers` defines (`Config(...).to_dict()`), and each field in turn
is changed to another value:

- a mapped field changes the converted `DecoderConfig`'s forward settings;
- a refused one raises `ConfigError` naming it and its value;
- a harmless or ignored one changes nothing, and for each field a family
  ignores, the `transformers` model agrees: its logits are unchanged too.
"""

from __future__ import annotations

import types
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from blocklab._validate import ConfigError  # noqa: E402
from blocklab.interop.families import gemma3  # noqa: E402
from blocklab.interop.hf_common import (  # noqa: E402
    HARMLESS_FIELDS,
    decoder_families,
    forward_settings,
    understood,
)

#: The registered decoder families (the encoders: test_hf_encoders).
FAMILIES = decoder_families()

V = 64
_DIMS = dict(
    hidden_size=32, intermediate_size=40, num_attention_heads=4,
    num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=16,
)  # fmt: skip
_TYPES = ["sliding_attention", "full_attention"]

#: family -> (config class, model class, tiny fields).
CONFIGS = {
    "gpt2": (
        "GPT2Config", "GPT2LMHeadModel",
        dict(n_embd=32, n_head=4, n_layer=2, n_positions=16),
    ),
    "llama": ("LlamaConfig", "LlamaForCausalLM", _DIMS),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", _DIMS),
    "gemma3": (
        "Gemma3TextConfig", "Gemma3ForCausalLM",
        dict(_DIMS, head_dim=8, query_pre_attn_scalar=8, sliding_window=4,
             layer_types=_TYPES),
    ),
    "mixtral": (
        "MixtralConfig", "MixtralForCausalLM",
        dict(_DIMS, num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DIMS, sliding_window=4)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", _DIMS),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(_DIMS, head_dim=8)),
    "gemma2": (
        "Gemma2Config", "Gemma2ForCausalLM",
        dict(_DIMS, head_dim=8, query_pre_attn_scalar=8, sliding_window=4),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", _DIMS),
}  # fmt: skip

#: Fields a family reads and that leave its logits unchanged, here: dropout
#: (the conversion refuses a model in training mode), the auxiliary loss, a
#: double-heads model's summary head, keys that only another setting reads
#: (Qwen's window fields when the layer types are explicit and all full,
#: Phi-3's long-RoPE length, Gemma's legacy pattern), legacy keys no code
#: reads. Each is checked against `transformers` below.
IGNORED = {
    "gpt2": {
        "resid_pdrop", "embd_pdrop", "attn_pdrop", "summary_type",
        "summary_use_proj", "summary_activation", "summary_proj_to_labels",
        "summary_first_dropout", "reorder_and_upcast_attn", "n_ctx",
    },
    "llama": {"attention_dropout", "pretraining_tp"},
    "olmo2": {"attention_dropout"},
    "gemma3": {
        "attention_dropout", "_sliding_window_pattern", "sliding_window_pattern",
        "hidden_act", "rope_theta", "rope_local_base_freq",
    },
    "mixtral": {
        "attention_dropout", "router_jitter_noise", "output_router_logits",
        "router_aux_loss_coef",
    },
    "mistral": {"attention_dropout"},
    "qwen2": {
        "attention_dropout", "use_sliding_window", "sliding_window",
        "max_window_layers",
    },
    "qwen3": {
        "attention_dropout", "use_sliding_window", "sliding_window",
        "max_window_layers",
    },
    "gemma2": {"attention_dropout", "hidden_act"},
    "phi3": {
        "attention_dropout", "resid_pdrop", "embd_pdrop",
        "original_max_position_embeddings",
    },
}  # fmt: skip

#: Fields a family understands that `Config().to_dict()` does not hold: keys
#: of older `config.json` files, keys the modeling code reads with `getattr`
#: (`head_dim` of Qwen 2 and Phi-3), and keys stored only when set.
NOT_IN_TO_DICT = {
    "gpt2": {"n_ctx"},
    "gemma3": {
        "hidden_act", "rope_theta", "rope_local_base_freq", "rope_scaling",
        "sliding_window_pattern", "text_config",
    },
    "gemma2": {"hidden_act"},
    "mistral": {"layer_types", "attention_bias", "mlp_bias"},
    "qwen2": {"head_dim"},
    "phi3": {"head_dim", "partial_rotary_factor"},
}  # fmt: skip

#: A changed value for a field whose value is `None`, by name.
_FROM_NONE = {
    "n_inner": 48,
    "head_dim": 16,
    "sliding_window": 4,
    "final_logit_softcapping": 5.0,
    "attn_logit_softcapping": 5.0,
    "use_bidirectional_attention": True,
    "summary_activation": "tanh",
    "pad_token_id": 1,
    "bos_token_id": 1,
    "eos_token_id": 1,
    "dtype": "bfloat16",
}


def perturb(name, value):
    """Another valid value of the field (a tiny config stays buildable)."""
    if name == "num_key_value_heads":
        return 1 if value != 1 else 2
    if name in ("id2label", "label2id"):
        return {}
    if name == "rope_scaling":
        return {"rope_type": "default", "rope_theta": 500.0}
    if value is None:
        return _FROM_NONE.get(name, 3)
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return 2 * value if value else 1
    if isinstance(value, float):
        return 0.5 * value if value else 0.25
    if isinstance(value, str):
        return "relu" if "act" in name else value + "_other"
    if isinstance(value, list):  # layer_types: the first layer's type flipped
        return [_TYPES[value[0] == "sliding_attention"]] + value[1:]
    if isinstance(value, dict) and "rope_theta" in value:
        return {**value, "rope_theta": 500.0}
    if isinstance(value, dict):  # per-layer-type rope parameters
        return {
            **value,
            "full_attention": {**value["full_attention"], "rope_theta": 500.0},
        }
    raise AssertionError(f"no perturbation for {name}={value!r}")


def hf_config(family, **overrides):
    config_cls, _, fields = CONFIGS[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, config_cls)(
            vocab_size=V, pad_token_id=0, bos_token_id=0, eos_token_id=0,
            **{**fields, **overrides},
        )  # fmt: skip


def _outcome(family, fields):
    """`("mapped"|"unchanged", settings)` or `("refused", message)`."""
    try:
        return "ok", forward_settings(FAMILIES[family].to_config(fields))
    except ConfigError as err:
        return "refused", str(err)


def test_every_family_has_a_config_here():
    assert set(FAMILIES) == set(CONFIGS)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_field_transformers_defines_is_understood(family):
    fam = FAMILIES[family]
    defined = set(hf_config(family).to_dict())
    assert defined <= set(fam.fields) | HARMLESS_FIELDS, sorted(
        defined - set(fam.fields) - HARMLESS_FIELDS
    )
    # what the family understands beyond them is named above, with a reason
    assert set(fam.fields) - defined == NOT_IN_TO_DICT.get(family, set())
    assert IGNORED[family] <= set(fam.fields)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_the_tables_defaults_are_transformers_defaults(family):
    """`Family.fields` holds `transformers`' defaults (a `config.json` lacks
    the fields at their default, so a wrong one would convert another model)."""
    fam = FAMILIES[family]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        defaults = getattr(transformers, CONFIGS[family][0])().to_dict()
    ours = vars(understood(fam.classes[0], {}, fam.fields))
    if family == "gemma3":  # the bases of the layer types are filled in later
        ours["rope_parameters"] = gemma3._rope_parameters(types.SimpleNamespace(**ours))
    for name, value in defaults.items():
        if name in ours:
            assert ours[name] == value, (name, ours[name], value)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_every_field_is_mapped_refused_or_harmless(family):
    base = hf_config(family).to_dict()
    kind, settings = _outcome(family, base)
    assert kind == "ok", settings
    for name in sorted(set(base) | IGNORED[family]):
        value = base.get(name)
        new = perturb(name, value)
        changed = {**base, name: new}
        if name == "num_hidden_layers":  # the layer types follow, as in transformers
            changed.pop("layer_types", None)
        kind, result = _outcome(family, changed)
        if name in HARMLESS_FIELDS or name in IGNORED[family]:
            assert kind == "ok" and result == settings, (name, new, result)
        elif kind == "refused":
            assert name in result, (name, new, result)
        else:  # mapped: the converted model differs
            assert result != settings, (name, new)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_ignored_fields_leave_the_transformers_logits_unchanged(family):
    """The independent check of `IGNORED`: the `transformers` model with the
    field changed, loaded with the same weights, computes the same logits."""
    config_cls, model_cls, _ = CONFIGS[family]
    base = hf_config(family).to_dict()
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, V, (1, 12)))
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = getattr(transformers, model_cls)(hf_config(family)).eval()
        with torch.no_grad():
            want = ref_model(ids).logits
        for name in sorted(IGNORED[family]):
            new = perturb(name, base.get(name))
            # the changed config as a config.json would hold it (from_dict)
            config = getattr(transformers, config_cls)(**{**base, name: new})
            model = getattr(transformers, model_cls)(config)
            model.load_state_dict(ref_model.state_dict())
            with torch.no_grad():
                got = model.eval()(ids).logits
            scale = want.abs().max().item()
            assert (got - want).abs().max().item() <= 1e-6 * scale, name


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_an_unknown_field_is_refused_by_name_unless_off(family):
    base = hf_config(family).to_dict()
    with pytest.raises(ConfigError, match=r"use_new_trick=3 .*understands"):
        FAMILIES[family].to_config({**base, "use_new_trick": 3})
    for off in (None, False):
        FAMILIES[family].to_config({**base, "use_new_trick": off})
