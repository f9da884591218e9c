"""Mixtral conversion: blocklab's MoE DecoderLM against `transformers`' PyTorch
MixtralForCausalLM (random weights from a config; nothing is downloaded)."""

import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import mixtral_config

import blocklab as bl
from blocklab.interop import to_huggingface_state_dict
from blocklab.models import MoEDecoderConfig

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _hf(top_k, window, *, seed=0, **extra):
    torch.manual_seed(seed)
    config = mixtral_config(
        top_k,
        window,
        initializer_range=0.2,  # logits of order 10: a sharp comparison
        attn_implementation="eager",
        **extra,
    )
    return transformers.MixtralForCausalLM(config).eval()


@pytest.mark.parametrize(
    ("top_k", "window"),
    [(1, None), (2, 4)],
    ids=["top1-full", "top2-gqa-window4"],
)
def test_logits_and_load_balancing_loss_match_transformers(top_k, window):
    hf = _hf(top_k, window)
    ids = torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = hf(ids, output_router_logits=True)
    want = out.logits.numpy()
    model = bl.from_huggingface(hf)
    assert isinstance(model.cfg, MoEDecoderConfig)
    assert (model.cfg.num_experts, model.cfg.top_k) == (4, top_k)
    assert model.cfg.num_kv_heads == 2 and model.cfg.window == window
    logits, stats = bl.nn.moe.moe_forward(model, jnp.asarray(ids.numpy()))
    scale = np.abs(want).max()
    assert scale > 1.0
    np.testing.assert_allclose(np.asarray(logits), want, rtol=0, atol=1e-4 * scale)
    # One sequence at a time gives the same logits.
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(ids[1].numpy()))), want[1], atol=1e-4 * scale
    )
    # transformers' load_balancing_loss_func over all layers (pooled), and the
    # router logits through the load: E * sum_e (k f_e) P_e.
    (s,) = stats
    aux = bl.nn.moe.load_balancing_loss(s.load, s.router_prob, top_k)
    np.testing.assert_allclose(float(aux), float(out.aux_loss), rtol=1e-5)
    for layer, gate_logits in enumerate(out.router_logits):
        p = torch.softmax(gate_logits.float(), -1)
        np.testing.assert_allclose(s.router_prob[layer], p.mean(0).numpy(), atol=1e-6)


def test_state_dict_round_trip_in_transformers_names():
    hf = _hf(2, 4)
    model = bl.from_huggingface(hf)
    # No family=: a Mixtral model resolves to Mixtral (the Llama family's
    # structure fits it too, but Llama cannot express its experts).
    ours = to_huggingface_state_dict(model)
    theirs = {k: v.numpy() for k, v in hf.state_dict().items()}
    assert set(ours) == set(theirs)
    for k, v in theirs.items():
        np.testing.assert_array_equal(ours[k], v, err_msg=k)


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok=5"),
        (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "linear"),
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    ],
)
def test_unsupported_mixtral_config_is_refused_by_name(extra, match):
    with pytest.raises(ValueError, match=match):
        bl.interop.hf_config_to_decoder(mixtral_config(**extra), "MixtralForCausalLM")


def test_router_jitter_in_training_mode_is_refused():
    hf = _hf(2, None, router_jitter_noise=0.1).train()
    with pytest.raises(ValueError, match="router_jitter_noise=0.1"):
        bl.from_huggingface(hf)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("routing", "sigmoid", "routing='sigmoid'"),
        ("top_k", 0, "top_k must lie in \\[1, 4\\], got 0"),
        ("num_experts", 0, "num_experts must lie in \\[1, inf\\], got 0"),
    ],
)
def test_moe_decoder_config_names_a_bad_value(field, value, match):
    with pytest.raises(ValueError, match=match):
        MoEDecoderConfig.mixtral(40, 16, 2, 1, **{"num_experts": 4, field: value})
