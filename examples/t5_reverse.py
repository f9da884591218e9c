"""A tiny T5 learns to reverse character strings; its greedy outputs are shown.

The encoder–decoder of T5 v1.1 (RMSNorm, gated GELU, relative position
buckets, no logit scaling, a tied head rescaled by d^-1/2) at a toy size:
the source is a random lowercase string of 3 to 8 characters followed by the
end token, as T5 feeds its inputs (right-padded, so every batch is ragged),
the target the same string reversed, then the end token. (The cross-attention
has no positions: the encoder learns each character's distance to the end
token from its relative position bias, the decoder its own step from its
causal one, and the cross-attention matches the two.) Training is teacher
forcing (the target shifted right behind the start token); decoding is the
model's greedy loop, which computes the cross-attention keys and values once
and then one cached step per token.

Defaults: d = 64, 4 heads, 2 + 2 blocks, batches of 64, AdamW at 3e-3 with a
warm-up and cosine decay, 3000 steps (several minutes on a 2-core CPU);
BLOCKLAB_TINY=1 shrinks everything to a few seconds (and the outputs are then
wrong).
"""

import os

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import blocklab as bl
from blocklab.models.encoder_config import EncoderDecoderConfig
from blocklab.models.encoder_decoder import EncoderDecoderLM
from blocklab.training.losses import seq2seq_loss

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, heads, blocks, B, steps = (16, 2, 1, 16, 30) if tiny else (64, 4, 2, 64, 3000)
PAD, EOS, LETTERS = 0, 1, "abcdefghijklmnopqrstuvwxyz"
V, S = 2 + len(LETTERS), 8  # ids: pad (also the start token), end, letters

cfg = EncoderDecoderConfig(
    V, d, heads, blocks,
    norm="rms", act="geglu", attn_scale=1.0, positions="relative",
    max_len=S + 1,
    head_scale=d**-0.5, decoder_start_token_id=PAD, eos_token_id=EOS,
    pad_token_id=PAD,
)  # fmt: skip
model_key, data_key, test_key = jax.random.split(jax.random.key(0), 3)
model = EncoderDecoderLM(cfg, key=model_key)
# T5 leaves its logits unscaled and folds 1/sqrt(d_kv) into the initial query
# weights instead (Mesh TensorFlow's initialization); so does this example.
model = eqx.tree_at(
    lambda m: (
        m.encoder.blocks.attention.W_q.weight,
        m.decoder.blocks.attention.W_q.weight,
        m.decoder.blocks.cross_attn.W_q.weight,
    ),
    model,
    replace_fn=lambda w: w * cfg.block.head_dim**-0.5,
)
print(f"T5: {bl.count_params(model)} parameters")


def strings(key, n):
    """`n` random strings as (source ids, source mask, reversed target + end)."""
    k_len, k_chr = jax.random.split(key)
    lens = jax.random.randint(k_len, (n,), 3, S + 1)
    chars = jax.random.randint(k_chr, (n, S), 2, V)
    pos = jnp.arange(S)
    mask = pos < lens[:, None]
    text = jnp.where(mask, chars, PAD)
    # reversed: target[t] = text[len - 1 - t] for t < len, then the end token
    rev = jnp.take_along_axis(text, jnp.clip(lens[:, None] - 1 - pos, 0, S - 1), 1)
    end = jnp.arange(S + 1) == lens[:, None]
    pad = jnp.full((n, 1), PAD)
    src = jnp.where(end, EOS, jnp.concatenate([text, pad], 1))
    tgt = jnp.where(end, EOS, jnp.concatenate([jnp.where(mask, rev, PAD), pad], 1))
    return src, jnp.arange(S + 1) <= lens[:, None], tgt


def batch(key):
    src, mask, tgt = strings(key, B)  # the target has the source's length
    tgt_in = jnp.concatenate([jnp.full((B, 1), PAD), tgt[:, :-1]], 1)
    return src, mask, tgt_in, jnp.where(mask, tgt, -100)


def loss_fn(model, batch, key):
    src, mask, tgt_in, tgt_out = batch
    return seq2seq_loss(model, src, tgt_in, tgt_out, src_mask=mask, key=key)


lr = optax.warmup_cosine_decay_schedule(0.0, 3e-3, max(steps // 20, 1), steps)
result = bl.train_model(
    model,
    batch,
    optax.adamw(lr, weight_decay=0.0),
    steps,
    key=data_key,
    loss_fn=loss_fn,
    run=bl.RunConfig(progress=False),
)
k = max(len(result.losses) // 3, 1)
print(
    f"loss, first / last {k} steps: "
    f"{result.losses[:k].mean():.3f} / {result.losses[-k:].mean():.3f}"
)

src, mask, _ = strings(test_key, 8)
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
