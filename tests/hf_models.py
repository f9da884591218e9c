"""Small `transformers` PyTorch models with random weights, for the tests that
compare blocklab against them (nothing is downloaded).

This module is a helper imported by the tests, not a test file; it imports
torch and transformers only when a helper is called, so that a test module
can still skip when they are missing.
"""

from __future__ import annotations


def randomize(model, *, gemma=False, seed=0, matrices=0.1, biases=0.1, embeddings=None):
    """Draw every parameter of `model` anew, in `named_parameters` order, from
    one generator seeded `seed`; return it in eval mode.

    Norm gains are 1 + N(0, 0.1^2) (Gemma's `1 + w` gains: N(0, 0.1^2)), so
    that a wrong `1 + w` or a swapped norm cannot hide behind unit gains;
    biases are N(0, biases^2); embeddings (token and GPT-2 position tables)
    N(0, embeddings^2) where `embeddings` is given; every other weight
    N(0, matrices^2).
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            is_norm = "norm" in name or ".ln_" in name or name.startswith("ln_")
            is_emb = "emb" in name or name.endswith(("wte.weight", "wpe.weight"))
            if is_norm and name.endswith("weight"):
                p.copy_((0.0 if gemma else 1.0) + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(biases * noise)
            elif embeddings is not None and is_emb:
                p.copy_(embeddings * noise)
            else:
                p.copy_(matrices * noise)
    return model.eval()


def mixtral_config(top_k=2, window=None, **fields):
    """A tiny `transformers.MixtralConfig`: 4 experts, `top_k` of them per
    token, 4 query heads on 2 key-value heads; `fields` override any field."""
    import transformers

    fields = {
        "vocab_size": 40,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_local_experts": 4,
        "num_experts_per_tok": top_k,
        "max_position_embeddings": 32,
        "sliding_window": window,
        **fields,
    }
    return transformers.MixtralConfig(**fields)
