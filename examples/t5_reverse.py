"""A tiny T5 learns to reverse character strings; its greedy outputs are shown.

The encoder–decoder of T5 v1.1 (RMSNorm, gated GELU, relative position
buckets, no logit scaling, a tied head rescaled by d^-1/2) at a toy size:
the source is a random lowercase string of 3 to 10 characters (right-padded,
so every batch is ragged), the target the same string reversed, then the end
token. Training is teacher forcing (the target shifted right behind the start
token); decoding is the model's greedy loop, which computes the
cross-attention keys and values once and then one cached step per token.

Defaults: d = 64, 4 heads, 2 + 2 blocks, batches of 64, AdamW at 3e-3, 1500
steps (a few minutes on a 2-core CPU); BLOCKLAB_TINY=1 shrinks everything to
a few seconds (and the outputs are then mostly wrong).
"""

import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blocklab as bl
from blocklab.nn.encoder_config import EncoderDecoderConfig
from blocklab.nn.encoder_decoder import EncoderDecoderLM
from blocklab.training.losses import seq2seq_loss

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, heads, blocks, B, steps = (16, 2, 1, 16, 30) if tiny else (64, 4, 2, 64, 1500)
PAD, EOS, LETTERS = 0, 1, "abcdefghijklmnopqrstuvwxyz"
V, S = 2 + len(LETTERS), 10  # ids: pad (also the start token), end, letters

cfg = EncoderDecoderConfig(
    V, d, heads, blocks,
    norm="rms", act="geglu", attn_scale=1.0, positions="relative",
    relative_num_buckets=8, relative_max_distance=16, max_len=S + 1,
    head_scale=d**-0.5, decoder_start_token_id=PAD, eos_token_id=EOS,
    pad_token_id=PAD,
)  # fmt: skip
model_key, data_key, test_key = jax.random.split(jax.random.key(0), 3)
model = EncoderDecoderLM(cfg, key=model_key)
print(f"T5: {bl.count_params(model)} parameters")


def strings(key, n):
    """`n` random strings as (source ids, source mask, reversed target + end)."""
    k_len, k_chr = jax.random.split(key)
    lens = jax.random.randint(k_len, (n,), 3, S + 1)
    chars = jax.random.randint(k_chr, (n, S), 2, V)
    pos = jnp.arange(S)
    mask = pos < lens[:, None]
    src = jnp.where(mask, chars, PAD)
    # reversed: target[t] = src[len - 1 - t] for t < len, then the end token
    rev = jnp.take_along_axis(src, jnp.clip(lens[:, None] - 1 - pos, 0, S - 1), 1)
    tgt = jnp.concatenate([jnp.where(mask, rev, PAD), jnp.full((n, 1), PAD)], 1)
    tgt = jnp.where(jnp.arange(S + 1) == lens[:, None], EOS, tgt)
    return src, mask, tgt, jnp.arange(S + 1) <= lens[:, None]


def batch(key):
    src, mask, tgt, tgt_mask = strings(key, B)
    tgt_in = jnp.concatenate([jnp.full((B, 1), PAD), tgt[:, :-1]], 1)
    return src, mask, tgt_in, jnp.where(tgt_mask, tgt, -100)


def loss_fn(model, batch, key):
    src, mask, tgt_in, tgt_out = batch
    return seq2seq_loss(model, src, tgt_in, tgt_out, src_mask=mask, key=key)


result = bl.train_model(
    model, batch, optax.adamw(3e-3, weight_decay=0.0), steps, key=data_key,
    loss_fn=loss_fn, progress=False,
)  # fmt: skip
k = max(len(result.losses) // 3, 1)
print(
    f"loss, first / last {k} steps: "
    f"{result.losses[:k].mean():.3f} / {result.losses[-k:].mean():.3f}"
)

src, mask, tgt, _ = strings(test_key, 8)
out = np.asarray(result.model.greedy(src, S + 1, src_mask=mask))


def text(ids):
    chars = []
    for i in np.asarray(ids):
        if i in (PAD, EOS):
            break
        chars.append(LETTERS[i - 2])
    return "".join(chars)


right = 0
for s, o in zip(np.asarray(src), out, strict=True):
    want = text(s)[::-1]
    right += text(o) == want
    print(f"  {text(s):>10} -> {text(o):<10} {'ok' if text(o) == want else 'x'}")
print(f"exact reversals: {right} / {len(out)}")
