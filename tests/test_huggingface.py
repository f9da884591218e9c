"""`from_huggingface` against the `transformers` PyTorch models, logit for logit.

Every model is built from a small config with random weights (nothing is
downloaded), every norm gain and bias is perturbed before the conversion (so
that a wrong `1 + w` or a swapped norm cannot hide behind unit gains), and the
reference is the PyTorch model's own forward pass in float32.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import randomize

torch = pytest.importorskip(
    "torch",
    reason="the Hugging Face comparisons need torch and transformers "
    "(python3 -m pip install -e '.[test]')",
)
transformers = pytest.importorskip(
    "transformers",
    reason="the Hugging Face comparisons need transformers "
    "(python3 -m pip install -e '.[test]')",
)

import blocklab  # noqa: E402
from blocklab import DecoderLM  # noqa: E402
from blocklab._validate import ConfigError  # noqa: E402
from blocklab.interop import (  # noqa: E402
    from_huggingface,
    hf_config_to_decoder,
    load_huggingface_state_dict,
    to_huggingface_state_dict,
)

VOCAB, D, HEADS, T = 96, 64, 4, 64
#: max |Δ logits| <= RTOL * max |logits| (the issue's bound).
RTOL = 1e-4


def _quiet(**kw):
    # Token ids inside the small vocabulary; eager attention (the reference).
    return dict(
        vocab_size=VOCAB,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
        attn_implementation="eager",
        **kw,
    )


def _gpt2(layout, **kw):
    cfg = transformers.GPT2Config(
        n_embd=D, n_head=HEADS, n_layer=2, n_positions=T, **_quiet(**kw)
    )
    return transformers.GPT2LMHeadModel(cfg)


def _kv(layout):
    return {"mha": HEADS, "gqa": 2, "mqa": 1}[layout]


def _llama_like(config_cls, model_cls, layout, **kw):
    cfg = getattr(transformers, config_cls)(
        hidden_size=D,
        intermediate_size=96,
        num_attention_heads=HEADS,
        num_key_value_heads=_kv(layout),
        num_hidden_layers=2,
        max_position_embeddings=T,
        **_quiet(**kw),
    )
    return getattr(transformers, model_cls)(cfg)


def _llama(layout, **kw):
    return _llama_like("LlamaConfig", "LlamaForCausalLM", layout, **kw)


def _olmo2(layout, **kw):
    return _llama_like("Olmo2Config", "Olmo2ForCausalLM", layout, **kw)


def _gemma3(layout, **kw):
    kw.setdefault("layer_types", ["sliding_attention", "full_attention"])
    cfg = transformers.Gemma3TextConfig(
        hidden_size=D,
        intermediate_size=96,
        num_attention_heads=HEADS,
        num_key_value_heads=_kv(layout),
        head_dim=kw.pop("head_dim", 16),
        query_pre_attn_scalar=kw.pop("query_pre_attn_scalar", 16),
        num_hidden_layers=len(kw["layer_types"]),
        sliding_window=kw.pop("sliding_window", 8),
        max_position_embeddings=T,
        **_quiet(**kw),
    )
    return transformers.Gemma3ForCausalLM(cfg)


#: One jitted forward for every test (compiled once per structure and shape).
forward = jax.jit(lambda model, ids: model(ids))

BUILDERS = {"gpt2": _gpt2, "llama": _llama, "olmo2": _olmo2, "gemma3": _gemma3}


def hf_model(family, layout="mha", **kw):
    return randomize(BUILDERS[family](layout, **kw), gemma=family == "gemma3")


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(ids))).logits.numpy()


def ids_batch(B=2, length=T, seed=0):
    return np.random.default_rng(seed).integers(0, VOCAB, (B, length))


def assert_close(ours, ref):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.shape == ref.shape and ours.dtype == np.float32
    err = np.abs(ours - ref).max()
    scale = np.abs(ref).max()
    assert scale > 0.5  # the test model produces logits of real size
    assert err <= RTOL * scale, (err, scale)


#: (family, attention layout, config overrides, also check one sequence (T,)).
CASES = [
    ("gpt2", "mha", {}, True),
    ("gpt2", "mha", {"n_inner": 80, "activation_function": "gelu"}, False),
    ("llama", "mha", {"attention_bias": True, "mlp_bias": True}, True),
    ("llama", "gqa", {"head_dim": 24}, False),
    ("llama", "mqa", {"rope_theta": 500.0, "tie_word_embeddings": True}, False),
    ("olmo2", "mha", {}, False),
    ("olmo2", "gqa", {}, True),
    ("olmo2", "mqa", {}, False),
    ("gemma3", "mha", {}, False),
    ("gemma3", "gqa", {"query_pre_attn_scalar": 24}, False),
    (
        "gemma3",
        "mqa",
        {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
        True,
    ),
]


@pytest.mark.parametrize(
    "family,layout,kw,single",
    CASES,
    ids=[f"{fam}-{lay}-{i}" for i, (fam, lay, _, _) in enumerate(CASES)],
)
def test_logits_match_transformers(family, layout, kw, single):
    model = hf_model(family, layout, **kw)
    ours = from_huggingface(model)
    assert isinstance(ours, DecoderLM)
    ids = ids_batch()
    ref = hf_logits(model, ids)
    assert_close(forward(ours, jnp.asarray(ids)), ref)  # a batch (B, T)
    if single:  # one sequence (T,): once per family (a compile each)
        assert_close(forward(ours, jnp.asarray(ids[1])), ref[1])


def test_gemma3_window_shorter_than_sequence_matters():
    """The sliding window changes the logits (T = 64 > window = 8), and the
    conversion follows it: a model converted as if global would not match."""
    model = hf_model("gemma3", "gqa")
    ours = from_huggingface(model)
    assert ours.cfg.window == 8 and ours.cfg.global_layers == (1,)
    ids = ids_batch(1)
    ref = hf_logits(model, ids)
    assert_close(forward(ours, ids), ref)
    # A window as long as the sequence is global attention (same RoPE bases).
    wide = dataclasses.replace(ours.cfg, window=T)
    as_global = load_huggingface_state_dict(wide, to_huggingface_state_dict(ours))
    err = np.abs(np.asarray(forward(as_global, ids)) - ref).max()
    assert err > 100 * RTOL * np.abs(ref).max()


def test_positions_argument_matches_position_ids():
    """Explicit positions (a generation offset) act as HF's `position_ids`."""
    model = hf_model("llama", "gqa")
    ours = from_huggingface(model)
    ids = ids_batch(1, 16)
    pos = np.arange(5, 21)[None]
    with torch.no_grad():
        ref = model(torch.as_tensor(ids), position_ids=torch.as_tensor(pos)).logits
    assert_close(ours(ids, positions=pos), ref.numpy())


# State dicts ------------------------------------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "llama", "olmo2", "gemma3"])
def test_state_dict_round_trip_is_exact(family):
    model = hf_model(family, "gqa" if family != "gpt2" else "mha")
    ours = from_huggingface(model)
    sd = to_huggingface_state_dict(ours)
    # The inverse reproduces the PyTorch weights bit for bit ...
    torch_sd = {k: v.numpy() for k, v in model.state_dict().items()}
    if ours.cfg.tie_embeddings:
        assert "lm_head.weight" not in sd
        torch_sd.pop("lm_head.weight")
    assert sd.keys() == torch_sd.keys()
    for k in sd:
        assert sd[k].dtype == torch_sd[k].dtype and np.array_equal(sd[k], torch_sd[k])
    # ... and loads back into blocklab bit for bit.
    again = load_huggingface_state_dict(ours.cfg, sd)
    for a, b in zip(
        jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(again), strict=True
    ):
        assert a.dtype == b.dtype and np.array_equal(np.asarray(a), np.asarray(b))


def test_state_dict_loads_into_pytorch():
    """A blocklab model's state dict drives the PyTorch model to its logits."""
    ours = from_huggingface(randomize(_llama("gqa"), seed=3))
    target = _llama("gqa").eval()  # other weights, replaced below
    sd = to_huggingface_state_dict(ours)
    missing, unexpected = target.load_state_dict(
        {k: torch.from_numpy(v.copy()) for k, v in sd.items()}, strict=False
    )
    assert not missing and not unexpected
    ids = ids_batch(2, 16)
    ref = hf_logits(target, ids)
    assert_close(forward(ours, ids), ref)


def test_state_dict_missing_key_named():
    ours = from_huggingface(hf_model("llama", "gqa"))
    sd = to_huggingface_state_dict(ours)
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['model\.layers\.1\.mlp"):
        load_huggingface_state_dict(ours, sd)


def test_state_dict_extra_key_named():
    ours = from_huggingface(hf_model("olmo2", "gqa"))
    sd = to_huggingface_state_dict(ours)
    sd["model.layers.0.self_attn.rotary.weight"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match=r"unexpected keys .*rotary\.weight"):
        load_huggingface_state_dict(ours.cfg, sd)


def test_state_dict_wrong_shape_names_key_and_both_shapes():
    ours = from_huggingface(hf_model("llama", "gqa"))
    sd = to_huggingface_state_dict(ours)
    sd["model.layers.0.self_attn.k_proj.weight"] = np.zeros((64, 64), np.float32)
    with pytest.raises(
        ValueError, match=r"k_proj\.weight'.*\(64, 64\).*expects shape \(32, 64\)"
    ):
        load_huggingface_state_dict(ours, sd)


def test_tied_head_must_equal_embedding():
    ours = from_huggingface(hf_model("gpt2"))
    sd = to_huggingface_state_dict(ours)
    sd["lm_head.weight"] = sd["transformer.wte.weight"].copy()
    load_huggingface_state_dict(ours, sd)  # equal: accepted
    sd["lm_head.weight"][0, 0] += 1.0
    with pytest.raises(ValueError, match="lm_head.weight differs"):
        load_huggingface_state_dict(ours, sd)


# Unsupported configurations ---------------------------------------------------------


def test_unsupported_class_named():
    with pytest.raises(ConfigError, match="Linear is not supported"):
        from_huggingface(torch.nn.Linear(2, 2))
    model = transformers.GPT2Model(_gpt2("mha").config)
    with pytest.raises(ConfigError, match="GPT2Model is not supported"):
        from_huggingface(model)


@pytest.mark.parametrize(
    "family,kw,field",
    [
        ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse"),
        ("gpt2", {"activation_function": "gelu_fast"}, "activation_function"),
        ("gpt2", {"scale_attn_weights": False}, "scale_attn_weights"),
        ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            "llama",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            r"rope_parameters\['rope_type'\]='linear'",
        ),
        (
            "llama",
            {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}},
            "partial_rotary_factor",
        ),
        ("olmo2", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "yarn"),
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping=50.0"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final_logit_softcapping=30"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional"),
    ],
)
def test_unsupported_config_field_named(family, kw, field):
    model = BUILDERS[family]("mha", **kw)
    with pytest.raises(ConfigError, match=field):
        hf_config_to_decoder(model.config, type(model).__name__)
    with pytest.raises(ConfigError, match=field):
        from_huggingface(model.eval())


def test_conversion_refuses_a_config_edited_after_the_model_and_meta_weights():
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = np.arange(8) % 64
    want = model(torch.tensor(ids)[None]).logits[0].detach().numpy()
    np.testing.assert_allclose(
        from_huggingface(model)(jnp.asarray(ids)), want, atol=1e-5
    )
    # ReLU is a supported activation (ReGLU): without the check the edited
    # config converts silently to a ReGLU model; the torch MLP keeps its SiLU.
    model.config.hidden_act = "relu"
    with pytest.raises(ConfigError, match=r"hidden_act='relu' but .* SiLUActivation"):
        from_huggingface(model)
    with torch.device("meta"):
        empty = transformers.LlamaForCausalLM(cfg).eval()
    with pytest.raises(ConfigError, match="meta device"):
        from_huggingface(empty)


def test_training_mode_with_dropout_refused():
    model = _gpt2("mha")  # dropout 0.1 by default, training mode
    model.train()
    with pytest.raises(ConfigError, match=r"attn_pdrop=0\.1.*eval\(\)"):
        from_huggingface(model)
    from_huggingface(model.eval())


# Training and diagnostics on converted models -----------------------------------------


def test_converted_model_trains():
    """A converted Llama trained with `blocklab.train_lm`: no error, the loss falls."""
    import optax

    model = from_huggingface(hf_model("llama", "gqa"))
    tokens = np.tile(np.arange(24), 40)  # a periodic corpus: learnable quickly
    data = blocklab.TokenDataset(tokens, 16, vocab_size=VOCAB)
    result = blocklab.train_lm(
        model,
        data,
        optax.adam(3e-3),
        20,
        key=jax.random.key(0),
        batch_size=4,
        steps_per_call=10,
        progress=False,
    )
    losses = np.asarray(result.losses)
    assert losses.shape == (20,) and np.all(np.isfinite(losses))
    assert losses[-3:].mean() < 0.5 * losses[:3].mean(), losses
    assert isinstance(result.model, DecoderLM)


@pytest.mark.parametrize("family", ["llama", "olmo2", "gemma3"])
def test_signal_stats_on_converted_stack(family):
    model = from_huggingface(hf_model(family, "gqa"))
    X = jax.random.normal(jax.random.key(0), (2, 8, D))
    stats = blocklab.signal_stats(model.stack, X)
    N = model.cfg.num_blks
    for name, value in stats.as_dict().items():
        value = np.asarray(value)
        assert value.shape == (N,), name
        assert np.all(np.isfinite(value)), name
    ent = np.asarray(stats.attn_entropy)
    assert np.all(ent >= 0) and np.all(ent <= math.log(8) + 1e-5)
    assert np.all(np.asarray(stats.grad_norms["W_q"]) > 0)


def test_olmo2_entropy_collapse_at_init_and_its_removal_by_qk_norm():
    """OLMo 2's placement (norm on what each branch writes) lets the stream grow
    like 1 + 2k, so without QK-norm the attention logits grow with depth and
    attention in the upper blocks collapses to nearly one-hot; OLMo 2's
    full-width QK-norm keeps every block near uniform attention (README,
    exercise 7). An OLMo 2 configuration from `transformers`, blocklab's init."""
    T = 16
    hf_cfg = transformers.Olmo2Config(
        hidden_size=D,
        intermediate_size=96,
        num_attention_heads=HEADS,
        num_hidden_layers=8,
        max_position_embeddings=T,
        **_quiet(),
    )
    cfg = hf_config_to_decoder(hf_cfg, "Olmo2ForCausalLM")
    assert cfg.qk_norm == "full" and cfg.placement == "output"
    X = jax.random.normal(jax.random.key(1), (2, T, D))
    uniform = math.log(T)
    result = {}
    for qk in ("full", False):
        stack = DecoderLM(
            dataclasses.replace(cfg, qk_norm=qk), key=jax.random.key(0)
        ).stack
        stats = blocklab.signal_stats(stack, X)
        result[qk] = (np.asarray(stats.attn_entropy), np.asarray(stats.max_logit))
    ent_qk, logit_qk = result["full"]
    ent_raw, logit_raw = result[False]
    # Stream mean square ~ 1 + 2k: the logits grow with depth without QK-norm
    # (measured 4.2 at block 1, ~53 at block 8) ...
    assert logit_raw[-1] > 5 * logit_raw[0]
    # ... and attention collapses (entropy ~0.3-0.5 against log 16 = 2.77),
    assert ent_raw[-4:].max() < 0.25 * uniform
    # while with QK-norm the logits stay bounded and attention near uniform.
    assert ent_qk.min() > 0.75 * uniform
    assert logit_qk.max() < 3 * math.sqrt(D // HEADS)


def test_gemma3_refuses_an_unknown_layer_type():
    """A `layer_types` entry that is neither full nor sliding attention
    (`chunked_attention`) was read as a local layer; it is refused by name."""
    import types

    from blocklab.interop.huggingface import FAMILIES

    hf = _gemma3("gqa", layer_types=["sliding_attention", "full_attention"]).config
    fields = dict(hf.to_dict(), layer_types=["sliding_attention", "chunked_attention"])
    with pytest.raises(ConfigError, match=r"layer_types.*chunked_attention"):
        FAMILIES["gemma3"].to_config(types.SimpleNamespace(**fields))
