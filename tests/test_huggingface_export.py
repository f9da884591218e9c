"""Export to `transformers`: a state dict is produced only when the target
family computes blocklab's logits, and then it does.

Each model is a blocklab `DecoderLM` with random weights (every gain and bias
perturbed, so a dropped or misplaced norm cannot hide behind unit gains). The
reference is the `transformers` PyTorch model built from the exported config
fields and loaded with the exported state dict: nothing is downloaded.
"""

from __future__ import annotations

import dataclasses

import equinox as eqx
import jax
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.interop import (
    FAMILIES,
    Rule,
    load_huggingface_state_dict,
    to_huggingface_state_dict,
)
from blocklab.interop.hf_common import resolve_family, unsupported_settings
from blocklab.models import DecoderConfig, DecoderLM, MoEDecoderConfig

V, D, H, T = 48, 32, 4, 12

#: family -> (a config of that family, the transformers config and model classes).
CASES = {
    "gpt2": (
        lambda: DecoderConfig.gpt2(V, D, H, 2, max_len=T),
        "GPT2Config",
        "GPT2LMHeadModel",
    ),
    "llama": (
        lambda: DecoderConfig.llama(
            V, D, H, 2, max_len=T, rope_theta=500.0, attn_bias=True
        ),
        "LlamaConfig",
        "LlamaForCausalLM",
    ),
    "olmo2": (
        lambda: DecoderConfig.olmo2(V, D, H, 2, num_kv_heads=2, max_len=T),
        "Olmo2Config",
        "Olmo2ForCausalLM",
    ),
    "gemma3": (
        lambda: DecoderConfig.gemma3(
            V,
            D,
            H,
            3,
            head_dim=16,
            window=4,
            global_every=2,
            max_len=T,
            query_pre_attn_scalar=24.0,
        ),  # fmt: skip
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
    ),
    "mixtral": (
        lambda: MoEDecoderConfig.mixtral(
            V, D, H, 2, num_experts=4, top_k=2, max_len=T, window=5, ffn_width=24
        ),  # torch's grouped matmul needs widths of multiples of 16 bytes
        "MixtralConfig",
        "MixtralForCausalLM",
    ),
}


def random_model(cfg: DecoderConfig, seed: int = 0) -> DecoderLM:
    """`DecoderLM(cfg)` with every float array perturbed by N(0, 0.1^2)."""
    model = DecoderLM(cfg, key=jax.random.key(seed))
    params, static = eqx.partition(model, eqx.is_inexact_array)
    leaves, tree = jax.tree_util.tree_flatten(params)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [
        x + 0.1 * jax.random.normal(k, x.shape, x.dtype)
        for x, k in zip(leaves, keys, strict=True)
    ]
    return eqx.combine(jax.tree_util.tree_unflatten(tree, leaves), static)


@pytest.mark.parametrize("family", sorted(CASES))
def test_exported_state_dict_gives_blocklabs_logits_in_transformers(family):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    make_cfg, config_cls, model_cls = CASES[family]
    cfg = make_cfg()
    model = random_model(cfg)
    sd = to_huggingface_state_dict(model)  # inferred: the one family that fits
    assert sd.keys() == to_huggingface_state_dict(model, family=family).keys()
    fields = FAMILIES[family].hf_fields(cfg)
    hf_config = getattr(transformers, config_cls)(
        **fields,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
    )
    hf = getattr(transformers, model_cls)(hf_config).eval()
    missing, unexpected = hf.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False
    )
    assert not unexpected
    # A tied head is the embedding itself in PyTorch: nothing else is missing.
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    ids = np.random.default_rng(0).integers(0, V, (2, T))
    with torch.no_grad():
        want = hf(torch.as_tensor(ids)).logits.numpy()
    got = np.asarray(model(ids))
    scale = np.abs(want).max()
    assert scale > 0.5  # logits of real size: a sharp comparison
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize(
    ("cfg", "family", "named"),
    [
        # issue 23: a windowed or rescaled Llama loaded with logits 69% off
        (DecoderConfig.llama(V, D, H, 2, window=4), "llama", r"window/global_layers"),
        (DecoderConfig.llama(V, D, H, 2, attn_scale=0.3), "llama", r"attn_scale=0.3"),
        # Gemma 3 as Llama silently dropped its QK-norm and sandwich gains
        (
            DecoderConfig.gemma3(V, D, H, 2),
            "llama",
            r"placement='sandwich' \(llama: 'pre'\).*qk_norm='head' \(llama: False\)",
        ),
        # GPT-2 and MoE as Llama raised a raw KeyError
        (DecoderConfig.gpt2(V, D, H, 2), "llama", r"norm='layer' \(llama: 'rms'\)"),
        (MoEDecoderConfig.mixtral(V, D, H, 2), "llama", r"num_experts=8"),
        (DecoderConfig.llama(V, D, H, 2), "mixtral", r"config class='DecoderConfig'"),
        (DecoderConfig.olmo2(V, D, H, 2, head_dim=16), "olmo2", r"head_dim=16"),
        (DecoderConfig.gpt2(V, D, H, 2, attn_bias=False), "gpt2", r"attn_bias=False"),
        (
            dataclasses.replace(
                MoEDecoderConfig.mixtral(V, D, H, 2), routing="softmax_topk"
            ),
            "mixtral",
            r"routing='softmax_topk' \(mixtral: 'mixtral'\)",
        ),
        # muP away from its base width multiplies the logits by d0/d
        (
            DecoderConfig.llama(
                V, D, H, 2, parametrization="mup", base_width=16, attn_scale=0.25
            ),
            "llama",
            r"readout multiplier \(muP d0/d\)=0.5",
        ),
        # a window on some layers only: Mistral and Phi-3 have one for all
        (
            DecoderConfig.llama(V, D, H, 3, window=4, global_layers=(2,)),
            "mistral",
            r"window/global_layers",
        ),
        (
            DecoderConfig.llama(V, D, H, 2, window=4, global_layers=(0,)),
            "phi3",
            r"window/global_layers",
        ),
        # Llama's biases on all four projections: Qwen 2 has none on o_proj
        (
            DecoderConfig.llama(V, D, H, 2, attn_bias=True),
            "qwen2",
            r"attn_out_bias=True \(qwen2: False\)",
        ),
        (DecoderConfig.llama(V, D, H, 2, attn_bias=True), "mistral", r"attn_bias"),
        (DecoderConfig.llama(V, D, H, 2, ffn_bias=True), "phi3", r"ffn_bias"),
        (
            DecoderConfig.llama(V, D, H, 2, qk_norm="full"),
            "qwen3",
            r"qk_norm='full' \(qwen3: 'head'\)",
        ),
        # Gemma 3's QK-norm and two RoPE bases are not Gemma 2's
        (DecoderConfig.gemma3(V, D, H, 2), "gemma2", r"qk_norm='head'"),
        # soft caps only Gemma 2 can write
        (
            DecoderConfig.llama(V, D, H, 2, final_softcap=30.0),
            "llama",
            r"final_softcap=30\.0 \(llama: None\)",
        ),
        (
            DecoderConfig.llama(V, D, H, 2, attn_softcap=50.0),
            "mistral",
            r"attn_softcap=50\.0",
        ),
    ],
    ids=[
        "llama-window",
        "llama-attn_scale",
        "gemma3-as-llama",
        "gpt2-as-llama",
        "moe-as-llama",
        "dense-as-mixtral",
        "olmo2-head_dim",
        "gpt2-no-bias",
        "mixtral-routing",
        "mup-readout",
        "mistral-some-global",
        "phi3-some-global",
        "qwen2-o-bias",
        "mistral-bias",
        "phi3-ffn-bias",
        "qwen3-full-qk",
        "gemma3-as-gemma2",
        "llama-final-softcap",
        "mistral-attn-softcap",
    ],  # fmt: skip
)
def test_export_refuses_what_the_family_cannot_express(cfg, family, named):
    model = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
    with pytest.raises(ConfigError, match=f"family='{family}' cannot express.*{named}"):
        to_huggingface_state_dict(model, family=family)


def test_a_config_no_family_expresses_is_refused_with_each_familys_reasons():
    cfg = DecoderConfig.llama(V, D, H, 2, window=4, placement="post")
    model = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"no registered .*llama: .*placement='post'"):
        to_huggingface_state_dict(model)


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_expresses_its_own_config_and_no_other_family_does(family):
    cfg = CASES[family][0]()
    able = [name for name, f in FAMILIES.items() if not unsupported_settings(cfg, f)]
    # besides the family, only its variants (Mistral and Phi-3 generalize
    # Llama), which inference passes over
    variants = {name for name in able if FAMILIES[name].variant_of in able}
    assert set(able) - variants == {family}
    assert resolve_family("t", cfg, None, check=False).name == family


def test_mixtral_model_resolves_to_mixtral_without_family():
    """issue 18: the Llama family's structure also fits an MoE config; export
    and load of a Mixtral model without `family=` pick Mixtral."""
    cfg = MoEDecoderConfig.mixtral(V, D, H, 2, num_experts=4)
    model = random_model(cfg)
    sd = to_huggingface_state_dict(model)
    assert "model.layers.1.mlp.experts.gate_up_proj" in sd
    assert sd.keys() == to_huggingface_state_dict(model, family="mixtral").keys()
    again = load_huggingface_state_dict(cfg, sd)
    for a, b in zip(
        jax.tree_util.tree_leaves(model), jax.tree_util.tree_leaves(again), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# The config mappings' refusals, without torch: the fields of a valid config
# with one field changed (each would otherwise convert into another model).

_GEMMA3 = DecoderConfig.gemma3(V, D, H, 2, window=4, global_every=2)


@pytest.mark.parametrize(
    ("family", "cfg", "change", "named"),
    [
        (
            "gemma3",
            _GEMMA3,
            {"layer_types": ["chunked_attention", "full_attention"]},
            "layer_types='chunked_attention'",
        ),
        ("gemma3", _GEMMA3, {"text_config": {"hidden_size": D}}, "text_config"),
        (
            "gemma3",
            _GEMMA3,
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "factor": 8.0}
                }
            },
            r"rope_parameters\['full_attention'\]\['factor'\]=8\.0",
        ),
        ("gemma3", _GEMMA3, {"sliding_window": None}, "sliding_window=None"),
        (
            "gpt2",
            DecoderConfig.gpt2(V, D, H, 2),
            {"add_cross_attention": True},
            "add_cross_attention=True",
        ),
        (
            "llama",
            DecoderConfig.llama(V, D, H, 2),
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "original_max_position_embeddings": 8,
                }
            },
            r"rope_parameters\['original_max_position_embeddings'\]=8",
        ),
        (
            "mixtral",
            MoEDecoderConfig.mixtral(V, D, H, 2, num_experts=4),
            {"num_local_experts": True},
            "num_local_experts=True",
        ),
    ],
    ids=[
        "gemma3-layer_types",
        "gemma3-text_config",
        "gemma3-rope-extra",
        "gemma3-no-window",
        "gpt2-cross-attention",
        "llama-rope-extra",
        "mixtral-bool-experts",
    ],  # fmt: skip
)
def test_config_mapping_refuses_a_changed_field_by_name(family, cfg, change, named):
    import types

    fam = FAMILIES[family]
    fields = fam.hf_fields(cfg)
    # The unchanged fields convert back to the same model ...
    assert not unsupported_settings(cfg, fam)
    # ... and the changed one is refused by name.
    with pytest.raises(ConfigError, match=named):
        fam.to_config(types.SimpleNamespace(**{**fields, **change}))


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: Rule("x.weight", ("W.weight",), "transpose"), r"kind must be one of"),
        (
            lambda: to_huggingface_state_dict(
                eqx.filter_eval_shape(
                    DecoderLM, DecoderConfig.llama(V, D, H, 1), key=jax.random.key(0)
                ),
                family="falcon",
            ),
            r"family must be one of \[.*'llama'.*\], got family='falcon'",
        ),
    ],
    ids=["rule-kind", "unknown-family"],
)
def test_bad_arguments_raise_config_error(make, match):
    with pytest.raises(ConfigError, match=match):
        make()
