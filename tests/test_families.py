"""Mistral, Qwen 2, Qwen 3, Gemma 2 and Phi-3 against `transformers`, logit for logit.

Each model is the `transformers` PyTorch model of a tiny config, with random
weights (every matrix N(0, 0.1^2), every norm gain and bias perturbed, so that
a dropped bias, a wrong `1 + w` or a swapped fused block cannot hide), in
multi-head, grouped-query and multi-query layouts, with windows shorter than
the sequence where the family has them. The reference is the PyTorch model's
own eager forward pass in float32; nothing is downloaded.
"""

from __future__ import annotations

import dataclasses
import types

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from blocklab._validate import ConfigError  # noqa: E402
from blocklab.interop import (  # noqa: E402
    FAMILIES,
    from_huggingface,
    hf_config_to_decoder,
    load_huggingface_state_dict,
    to_huggingface_state_dict,
)
from blocklab.interop.hf_common import (  # noqa: E402
    forward_settings,
    resolve_family,
    unsupported_settings,
)
from blocklab.interop.porting import load_state_dict, param_shapes  # noqa: E402
from blocklab.models import DecoderConfig, DecoderLM  # noqa: E402
from blocklab.models.decoder import set_layer_data  # noqa: E402

V, D, H, T = 96, 64, 4, 24
#: max |Δ logits| <= RTOL * max |logits| (the issue's bound in float32).
RTOL = 1e-5

#: family -> (config class, model class).
CLASSES = {
    "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
}
KV = {"mha": H, "gqa": 2, "mqa": 1}


def hf_config(family, layout="gqa", **kw):
    """A tiny `transformers` config of `family` (2 layers unless `layer_types`)."""
    fields = dict(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=80,
        num_attention_heads=H,
        num_key_value_heads=KV[layout],
        num_hidden_layers=len(kw.get("layer_types") or (0, 0)),
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,  # Phi-3's default 32000 is outside a tiny vocabulary
        attn_implementation="eager",
    )
    if family == "gemma2":
        fields.update(head_dim=16, query_pre_attn_scalar=16, sliding_window=8)
    if family == "mistral":
        fields.update(sliding_window=None)
    fields.update(kw)
    return getattr(transformers, CLASSES[family][0])(**fields)


def hf_model(family, layout="gqa", seed=0, **kw):
    """N(0, 0.1^2) weights; norm gains 1 + N(0, 0.1^2) (Gemma: N(0, 0.1^2))."""
    model = getattr(transformers, CLASSES[family][1])(hf_config(family, layout, **kw))
    return randomize(model, gemma=family == "gemma2", seed=seed)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.numpy()


def ids_batch(B=2, length=T, seed=0):
    return np.random.default_rng(seed).integers(0, V, (B, length))


def assert_close(ours, ref, rtol=RTOL):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    err, scale = np.abs(ours - ref).max(), np.abs(ref).max()
    assert scale > 0.5  # logits of real size: a sharp comparison
    assert err <= rtol * scale, (err, scale)


forward = jax.jit(lambda model, ids: model(ids))

#: (family, layout, config fields): every family in MHA, GQA and MQA, with
#: windows (8 < T = 24), free head widths, biases and soft caps.
CASES = [
    ("mistral", "mha", {"sliding_window": 8}),
    ("mistral", "gqa", {"head_dim": 24}),
    ("mistral", "mqa", {"sliding_window": 5, "rope_theta": 500.0}),
    ("qwen2", "mha", {}),
    (
        "qwen2",
        "gqa",
        {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1},
    ),  # fmt: skip
    ("qwen2", "mqa", {"head_dim": 8, "tie_word_embeddings": True}),
    ("qwen3", "mha", {"head_dim": 24}),
    ("qwen3", "gqa", {"head_dim": 8, "attention_bias": True}),
    (
        "qwen3",
        "mqa",
        {
            "head_dim": 16,
            "use_sliding_window": True,
            "sliding_window": 7,
            "max_window_layers": 0,
        },
    ),  # fmt: skip
    (
        "gemma2",
        "mha",
        {"attn_logit_softcapping": 1.0, "final_logit_softcapping": 2.0},
    ),  # fmt: skip
    ("gemma2", "gqa", {"query_pre_attn_scalar": 24, "attention_bias": True}),
    (
        "gemma2",
        "mqa",
        {
            "layer_types": ["full_attention", "sliding_attention", "sliding_attention"],
            "final_logit_softcapping": None,
        },
    ),  # fmt: skip
    ("phi3", "mha", {}),
    ("phi3", "gqa", {"sliding_window": 6}),
    ("phi3", "mqa", {"head_dim": 24, "rms_norm_eps": 1e-3}),
]


@pytest.mark.parametrize(
    "family,layout,kw", CASES, ids=[f"{f}-{lay}" for f, lay, _ in CASES]
)
def test_logits_and_state_dict_match_transformers(family, layout, kw):
    model = hf_model(family, layout, **kw)
    ours = from_huggingface(model)
    assert isinstance(ours, DecoderLM)
    ids = ids_batch()
    assert_close(forward(ours, jnp.asarray(ids)), hf_logits(model, ids))
    # The state dict back in the family's names and layouts, bit for bit
    # (a fused qkv_proj split at the wrong rows would not be) ...
    sd = to_huggingface_state_dict(ours, family=family)
    want = {k: v.numpy() for k, v in model.state_dict().items()}
    if ours.cfg.tie_embeddings:
        want.pop("lm_head.weight", None)
    assert sd.keys() == want.keys()
    for k in sd:
        assert sd[k].dtype == want[k].dtype and np.array_equal(sd[k], want[k]), k
    # ... and into blocklab again, bit for bit.
    again = load_huggingface_state_dict(ours.cfg, sd, family=family)
    for a, b in zip(
        jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(again), strict=True
    ):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_the_settings_each_family_adds_change_the_logits():
    """Each family's own setting matters at these sizes (a conversion that
    dropped it would fail the comparison above): the window (T > w), the q/k/v
    biases, the per-head QK-norm, both soft caps."""
    ids = ids_batch(1)
    checks = [
        ("mistral", {"sliding_window": 8}, {"window": None}, ()),
        ("qwen2", {}, {"attn_bias": False, "attn_out_bias": None}, ("_proj.bias",)),
        ("qwen3", {"head_dim": 16}, {"qk_norm": False}, ("q_norm", "k_norm")),
        (
            "gemma2",
            {"attn_logit_softcapping": 1.0, "final_logit_softcapping": None},
            {"attn_softcap": None},
            (),
        ),
        ("gemma2", {"final_logit_softcapping": 2.0}, {"final_softcap": None}, ()),
    ]
    for family, kw, change, drop in checks:
        model = hf_model(family, **kw)
        ours = from_huggingface(model)
        cfg = dataclasses.replace(ours.cfg, **change)
        params = {
            k: v
            for k, v in to_huggingface_state_dict(ours, family=family).items()
            if not any(d in k for d in drop)
        }
        other = load_huggingface_state_dict(cfg, params, family=family)
        ref = hf_logits(model, ids)
        err = np.abs(np.asarray(forward(other, ids)) - ref).max()
        assert err > 100 * RTOL * np.abs(ref).max(), (family, change)


# Export: a blocklab model of each family drives transformers to its logits ------


def random_model(cfg, seed=0):
    """A `DecoderLM(cfg)` with N(0, 0.1^2) weights and gains 1 + N(0, 0.1^2)
    (Gemma's stored $w$: N(0, 0.1^2)), drawn with NumPy into the model's
    skeleton (no weight-drawing program to compile)."""
    skeleton = eqx.filter_eval_shape(DecoderLM, cfg, key=jax.random.key(0))
    rng = np.random.default_rng(seed)
    unit = 0.0 if cfg.norm == "gemma_rms" else 1.0
    params = {
        name: (unit if "norm" in name else 0.0)
        + rng.normal(0.0, 0.1, shape).astype(np.float32)
        for name, shape in param_shapes(skeleton).items()
    }
    model = load_state_dict(skeleton, params)
    return eqx.tree_at(lambda m: m.stack, model, set_layer_data(model.stack, cfg))


def _blocklab_cfg(family):
    """A blocklab config of `family`, built from blocklab's side (other sizes
    than the cases above: d = 48, 6 heads, 3 layers)."""
    llama = dict(num_kv_heads=3, max_len=T, ffn_width=40)
    if family == "mistral":
        return DecoderConfig.llama(V, 48, 6, 3, window=5, **llama)
    if family == "qwen2":
        return DecoderConfig.llama(
            V, 48, 6, 3, attn_bias=True, attn_out_bias=False, window=4,
            global_layers=(0, 1), **llama,
        )  # fmt: skip
    if family == "qwen3":
        return DecoderConfig.llama(V, 48, 6, 3, head_dim=12, qk_norm="head", **llama)
    if family == "gemma2":
        return DecoderConfig(
            V, 48, 6, 3, num_kv_heads=2, head_dim=12, ffn_width=40, act="geglu",
            norm="gemma_rms", placement="sandwich", max_len=T, window=4,
            global_layers=(1,), attn_scale=20.0**-0.5, embed_scale=48**0.5,
            attn_softcap=3.0, final_softcap=4.0,
        )  # fmt: skip
    return DecoderConfig.llama(V, 48, 6, 3, norm_eps=1e-5, window=6, **llama)


@pytest.mark.parametrize(
    "family",
    [
        # (tests/test_pretrained.py exports every family through save_pretrained)
        pytest.param("mistral", marks=pytest.mark.slow),
        pytest.param("qwen3", marks=pytest.mark.slow),
        "qwen2",
        "gemma2",
        "phi3",
    ],
)
def test_exported_model_computes_blocklabs_logits_in_transformers(family):
    cfg = _blocklab_cfg(family)
    model = random_model(cfg)
    sd = to_huggingface_state_dict(model, family=family)
    fields = FAMILIES[family].hf_fields(cfg)
    config_cls, model_cls = CLASSES[family]
    hf_cfg = getattr(transformers, config_cls)(
        **fields, bos_token_id=0, eos_token_id=0, pad_token_id=0,
        attn_implementation="eager",
    )  # fmt: skip
    hf = getattr(transformers, model_cls)(hf_cfg).eval()
    missing, unexpected = hf.load_state_dict(
        {k: torch.from_numpy(np.array(v)) for k, v in sd.items()}, strict=False
    )
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if cfg.tie_embeddings else set())
    ids = ids_batch(2, T, seed=1)
    assert_close(forward(model, ids), hf_logits(hf, ids))


def test_inference_picks_the_plainest_family():
    """Mistral generalizes Llama (a window) and Phi-3 Mistral (fused
    projections); without `family=`, a config goes to the plainest family
    that expresses it, and a family's own settings to that family."""

    def inferred(cfg):
        return resolve_family("t", cfg, None, check=False).name

    assert inferred(DecoderConfig.llama(V, D, H, 2)) == "llama"
    for name in ("mistral", "phi3"):
        assert not unsupported_settings(DecoderConfig.llama(V, D, H, 2), FAMILIES[name])
    assert inferred(DecoderConfig.llama(V, D, H, 2, window=4)) == "mistral"
    assert inferred(_blocklab_cfg("qwen2")) == "qwen2"
    assert inferred(_blocklab_cfg("qwen3")) == "qwen3"
    assert inferred(_blocklab_cfg("gemma2")) == "gemma2"


# Config mappings: refusals by name, and config.json defaults ----------------------


@pytest.mark.parametrize(
    ("family", "kw", "named"),
    [
        ("mistral", {"layer_types": ["full_attention"] * 2}, "layer_types"),
        ("mistral", {"attention_bias": True}, "attention_bias=True"),
        ("mistral", {"mlp_bias": True}, "mlp_bias=True"),
        (
            "qwen2",
            {"layer_types": ["full_attention", "sliding_attention"]},
            "layer_types.*use_sliding_window",
        ),
        ("qwen3", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked"),
        # an unknown layer type is refused, not read as a local layer
        ("gemma2", {"layer_types": ["full_attention", "chunked_attention"]}, "chunked"),
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional"),
        ("gemma2", {"hidden_activation": "gelu_fast"}, "hidden_activation"),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "longrope",
                    "rope_theta": 1e4,
                    "short_factor": [1.0] * 8,
                    "long_factor": [2.0] * 8,
                }
            },  # fmt: skip
            r"rope_type'\]='longrope'.*long-RoPE",
        ),
        (
            "phi3",
            {
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 1e4,
                    "partial_rotary_factor": 0.5,
                }
            },  # fmt: skip
            "partial_rotary_factor",
        ),
        ("phi3", {"hidden_act": "gelu"}, "hidden_act=.gelu."),
    ],
)
def test_config_field_refused_by_name(family, kw, named):
    cfg = hf_config(family, **kw)
    with pytest.raises(ConfigError, match=named):
        hf_config_to_decoder(cfg, CLASSES[family][1])


@pytest.mark.parametrize(
    ("family", "rope"),
    [("phi3", {"type": "su"}), ("phi3", {"type": "yarn"})],
)
def test_phi3_legacy_long_rope_names_refused(family, rope):
    """A `config.json` of an early Phi-3 (`rope_scaling` with `"su"` or
    `"yarn"`, both long-RoPE in transformers) is refused by that name."""
    raw = {"hidden_size": D, "num_attention_heads": H, "rope_scaling": rope}
    with pytest.raises(ConfigError, match=f"'{rope['type']}'.*long-RoPE"):
        FAMILIES[family].to_config(raw)


#: A config.json of each family as `save_pretrained` writes it: only the fields
#: that differ from the defaults, which switch maths on when absent.
RAW = {
    "mistral": {},  # sliding_window absent: 4096
    "qwen2": {"sliding_window": 6},  # ignored without use_sliding_window
    "qwen3": {"use_sliding_window": True, "max_window_layers": 1},  # window 4096
    "gemma2": {"head_dim": 16},  # soft caps 50 and 30, alternating layers
    "phi3": {"rope_theta": 500.0},  # the legacy top-level key
}


@pytest.mark.parametrize("family", sorted(RAW))
def test_a_sparse_config_json_reads_as_transformers_reads_it(family):
    raw = dict(
        vocab_size=V, hidden_size=D, intermediate_size=80, num_attention_heads=H,
        num_key_value_heads=2, num_hidden_layers=3, **RAW[family],
    )  # fmt: skip
    ours = FAMILIES[family].to_config(raw)
    theirs = FAMILIES[family].to_config(
        getattr(transformers, CLASSES[family][0])(**raw, pad_token_id=0)
    )
    assert forward_settings(ours) == forward_settings(theirs)
    if family in ("mistral", "gemma2", "qwen3"):
        assert ours.window == 4096
    if family == "gemma2":
        assert ours.global_layers == (1,)
        assert (ours.attn_softcap, ours.final_softcap) == (50.0, 30.0)
    if family == "qwen2":
        assert ours.window is None
    if family == "phi3":
        assert ours.rope_theta == 500.0


def test_unknown_field_refused_but_off_values_accepted():
    cfg = hf_config("qwen3", head_dim=16)
    fields = dict(cfg.to_dict(), use_new_trick=True)
    with pytest.raises(ConfigError, match=r"use_new_trick=True.*understands"):
        FAMILIES["qwen3"].to_config(types.SimpleNamespace(**fields))
    for off in (None, False):
        FAMILIES["qwen3"].to_config(dict(fields, use_new_trick=off))
