"""Small decoders of every family and the references that check decoding:
shared by tests/test_generation.py and tests/test_decode_unrolled.py."""

import equinox as eqx
import jax
import numpy as np

from blocklab import CharLM, DecoderConfig, DecoderLM
from blocklab.models import MoEDecoderConfig

V = 61


def sharpen(model, seed=1):
    """Embeddings of unit size (logits of order 1-10, not ~0.1): a sharp test."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    emb = model.token_emb.weight
    model = eqx.tree_at(
        lambda m: m.token_emb.weight, model, jax.random.normal(k1, emb.shape)
    )
    if model.pos_emb is not None:
        pos = model.pos_emb.weight
        model = eqx.tree_at(
            lambda m: m.pos_emb.weight, model, 0.5 * jax.random.normal(k2, pos.shape)
        )
    return model


#: (name, config): every family, on widths, head ratios and windows that are
#: not the presets' defaults.
FAMILIES = {
    "gpt2": lambda: DecoderConfig.gpt2(V, 32, 4, 2, max_len=40),
    "llama-gqa": lambda: DecoderConfig.llama(V, 48, 6, 2, num_kv_heads=2, max_len=40),
    "olmo2-mqa": lambda: DecoderConfig.olmo2(V, 32, 4, 2, num_kv_heads=1, max_len=40),
    "gemma3-window3": lambda: DecoderConfig.gemma3(
        V, 32, 4, 2, num_kv_heads=2, head_dim=8, window=3, global_every=2, max_len=40
    ),
    "mixtral-window5": lambda: MoEDecoderConfig.mixtral(
        V, 32, 4, 2, num_experts=4, top_k=2, num_kv_heads=2, window=5, max_len=40
    ),
}


#: The uncached reference forward, compiled once per structure and shape.
forward = jax.jit(lambda model, ids: model(ids))


def model_of(name, seed=0):
    if name == "charlm":
        model = CharLM(V, 32, 4, 2, max_len=40, key=jax.random.key(seed))
    else:
        model = DecoderLM(FAMILIES[name](), key=jax.random.key(seed))
    return sharpen(model, seed + 1)


def greedy_reference(model, prompts, lengths, n, eos_id=None):
    """Python loop: one uncached forward of the padded rows per new token."""
    B, T = prompts.shape
    seqs = np.zeros((B, T + n), np.int32)
    seqs[:, :T] = prompts
    cur = np.array(lengths)
    done = np.zeros(B, bool)
    for _ in range(n):
        logits = np.asarray(forward(model, seqs))
        nxt = logits[np.arange(B), cur - 1].argmax(-1)
        if eos_id is not None:
            nxt = np.where(done, eos_id, nxt)
            done |= nxt == eos_id
        seqs[np.arange(B), cur] = nxt
        cur = cur + 1
    # row b: its prompt, its n new tokens, then the padding value
    out = np.full_like(seqs, 0 if eos_id is None else eos_id)
    for b in range(B):
        out[b, : lengths[b] + n] = seqs[b, : lengths[b] + n]
    return out
