"""Activation sites of converted models against `transformers` (issue 32).

For every family `blocklab.from_huggingface` converts, a tiny `transformers`
PyTorch model with random weights (from a config; nothing is downloaded) is
converted, and `blocklab.interp.capture` on a batch of two prompts is compared
with what the PyTorch model itself reports in float32:

- the residual stream: `output_hidden_states` holds $L + 1$ entries. Entry 0
  is the input of block 0 (the token embedding, with GPT-2's learned
  positions added and Gemma's $\\sqrt d$ scale applied): `blocks.0.
  hook_resid_pre`. Entry $l$, $1 \\le l < L$, is the output of block $l - 1$:
  `blocks.{l-1}.hook_resid_post`. Entry $L$ is *not* the last block's output
  but the final norm's, $\\mathrm{Norm}(h_L)$ (`transformers` replaces the
  last block's output by `last_hidden_state`): it is compared with the final
  norm (`model.norm`) of `blocks.{L-1}.hook_resid_post`, and
  `blocks.{L-1}.hook_resid_post` itself with the input of the PyTorch final
  norm, read by a forward pre-hook on that module;
- `ln_final.hook_normalized` (before the norm's gain and bias, as in
  TransformerLens) against that input normalised in NumPy, and
  `unembed.hook_out` against the logits;
- the attention pattern `blocks.*.attn.hook_pattern` against
  `output_attentions` of the eager attention, per layer `(B, H, T, T)` with
  every query head (grouped-query models included);
- Mixtral's router logits `blocks.*.mlp.hook_router_logits` `(B, T, E)`
  against `output_router_logits` (`(B T, E)` per layer).

Every comparison is max |ours - ref| <= 1e-5 max |ref| (float32 rounding).
The models have two or three layers, grouped-query attention where the family
has it, and windows (6) shorter than the prompts (16) where it has them; a
check on the PyTorch patterns shows the windows mask some causal positions.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from hf_models import mixtral_config, randomize

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from blocklab.interop import from_huggingface  # noqa: E402
from blocklab.interp import capture  # noqa: E402

V, D, B, T, W = 64, 32, 2, 16, 6
#: max |ours - ref| <= RTOL * max |ref| (the issue's bound in float32).
RTOL = 1e-5

_COMMON = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_hidden_layers=2,
    max_position_embeddings=32,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
    attn_implementation="eager",
)


def _llama_like(config, model, **kw):
    cfg = getattr(transformers, config)(**{**_COMMON, **kw})
    return getattr(transformers, model)(cfg)


def _gpt2():
    cfg = transformers.GPT2Config(
        vocab_size=V, n_embd=D, n_head=4, n_layer=2, n_positions=32,
        bos_token_id=0, eos_token_id=0, pad_token_id=0, attn_implementation="eager",
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


#: family -> (builder, has a window shorter than T). GQA (4 query heads on 2
#: key-value heads) everywhere but GPT-2; three layers for the Gemmas (local,
#: global, local).
FAMILIES = {
    "gpt2": (_gpt2, False),
    "llama": (lambda: _llama_like("LlamaConfig", "LlamaForCausalLM"), False),
    "mistral": (
        lambda: _llama_like("MistralConfig", "MistralForCausalLM", sliding_window=W),
        True,
    ),
    "qwen2": (
        lambda: _llama_like(
            "Qwen2Config",
            "Qwen2ForCausalLM",
            use_sliding_window=True,
            sliding_window=W,
            max_window_layers=1,
        ),  # fmt: skip
        True,
    ),
    "qwen3": (
        lambda: _llama_like("Qwen3Config", "Qwen3ForCausalLM", head_dim=16),  # QK-norm
        False,
    ),
    "olmo2": (lambda: _llama_like("Olmo2Config", "Olmo2ForCausalLM"), False),
    "gemma2": (
        lambda: _llama_like(
            "Gemma2Config",
            "Gemma2ForCausalLM",
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=W,
            attn_logit_softcapping=1.0,
            final_logit_softcapping=2.0,
        ),  # fmt: skip
        True,
    ),
    "gemma3": (
        lambda: _llama_like(
            "Gemma3TextConfig",
            "Gemma3ForCausalLM",
            num_hidden_layers=3,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=W,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        ),  # fmt: skip
        True,
    ),
    "phi3": (
        lambda: _llama_like("Phi3Config", "Phi3ForCausalLM", sliding_window=W),
        True,
    ),
    "mixtral": (
        lambda: transformers.MixtralForCausalLM(
            mixtral_config(2, W, vocab_size=V, attn_implementation="eager")
        ),
        True,
    ),
}

SITES = [
    "blocks.*.hook_resid_pre",
    "blocks.*.hook_resid_post",
    "blocks.*.attn.hook_pattern",
    "ln_final.hook_normalized",
    "unembed.hook_out",
]


def assert_close(ours, ref, what):
    ours, ref = np.asarray(ours), np.asarray(ref)
    assert ours.dtype == np.float32, what
    assert ours.shape == ref.shape, (what, ours.shape, ref.shape)
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    assert scale > 0.5, (what, scale)  # values of real size: a sharp comparison
    assert err <= RTOL * scale, (what, err, scale)


def _final_norm(hf):
    """The PyTorch final norm module and its epsilon."""
    if hasattr(hf, "transformer"):  # GPT-2
        return hf.transformer.ln_f, hf.config.layer_norm_epsilon
    return hf.model.norm, hf.config.rms_norm_eps


def _normalized(x, layer_norm, eps):
    """The final norm before its gain and bias, in float64 NumPy:
    $(x - \\mu) / \\sqrt{\\sigma^2 + \\epsilon}$ (LayerNorm) or
    $x / \\sqrt{\\overline{x^2} + \\epsilon}$ (RMSNorm)."""
    x = x.astype(np.float64)
    if layer_norm:
        x = x - x.mean(-1, keepdims=True)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def _causal_zeros(pattern):
    """Whether a `(B, H, T, T)` pattern is exactly 0 somewhere at or below the
    diagonal (a key the causal mask shows but a window hides)."""
    causal = np.tril(np.ones(pattern.shape[-2:], bool))
    return bool((pattern[..., causal] == 0).any())


@pytest.mark.parametrize("family", list(FAMILIES))
def test_sites_match_transformers(family):
    build, windowed = FAMILIES[family]
    # embeddings N(0, 0.3^2): a residual stream of order 1 from the start
    hf = randomize(build(), gemma=family.startswith("gemma"), embeddings=0.3)
    ours = from_huggingface(hf)
    L = ours.cfg.num_blks
    ids = np.random.default_rng(0).integers(0, V, (B, T))

    norm, eps = _final_norm(hf)
    seen = []
    handle = norm.register_forward_pre_hook(lambda mod, args: seen.append(args[0]))
    extra = {"output_router_logits": True} if family == "mixtral" else {}
    try:
        with torch.no_grad():
            out = hf(
                torch.as_tensor(ids),
                output_hidden_states=True,
                output_attentions=True,
                **extra,
            )
    finally:
        handle.remove()
    hidden = [h.numpy() for h in out.hidden_states]
    attentions = [a.numpy() for a in out.attentions]
    assert len(hidden) == L + 1 and len(attentions) == L and len(seen) == 1

    sites = list(SITES)
    if family == "mixtral":
        sites.append("blocks.*.mlp.hook_router_logits")
    logits, values = capture(ours, jnp.asarray(ids), sites)
    pre = np.asarray(values["blocks.*.hook_resid_pre"])
    post = np.asarray(values["blocks.*.hook_resid_post"])
    assert post.shape == (L, B, T, D)

    # entry 0: the embedding, the input of block 0
    assert_close(pre[0], hidden[0], "hidden_states[0]")
    # entries 1 .. L-1: the outputs of blocks 0 .. L-2
    for layer in range(L - 1):
        assert_close(post[layer], hidden[layer + 1], f"resid_post {layer}")
    # entry L is Norm(h_L): the last block's output is the final norm's input
    assert_close(post[L - 1], seen[0].numpy(), f"resid_post {L - 1}")
    assert_close(
        ours.norm(jnp.asarray(post[L - 1])), hidden[L], "final norm (hidden_states[L])"
    )
    layer_norm = family == "gpt2"
    assert_close(
        values["ln_final.hook_normalized"],
        _normalized(seen[0].numpy(), layer_norm, eps),
        "ln_final.hook_normalized",
    )
    assert_close(logits, out.logits.numpy(), "logits")
    np.testing.assert_array_equal(values["unembed.hook_out"], logits)

    pattern = np.asarray(values["blocks.*.attn.hook_pattern"])
    assert pattern.shape == (L, B, 4, T, T)
    for layer in range(L):
        assert_close(pattern[layer], attentions[layer], f"pattern {layer}")
    # the windows (W < T) hide causal keys in some layer: they were exercised
    assert windowed == any(_causal_zeros(a) for a in attentions)

    if family == "mixtral":
        router = np.asarray(values["blocks.*.mlp.hook_router_logits"])
        E = hf.config.num_local_experts
        assert router.shape == (L, B, T, E)
        hf_router = getattr(out, "router_logits", None)
        if hf_router is not None:  # transformers exposes them: (B T, E) per layer
            assert len(hf_router) == L
            for layer in range(L):
                assert_close(
                    router[layer].reshape(B * T, E),
                    hf_router[layer].float().numpy(),
                    f"router logits {layer}",
                )
