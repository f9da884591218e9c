"""Masked-language-model training of a small BERT-style encoder on The Time Machine.

A post-norm, LayerNorm, exact-GELU encoder with learned positions and the MLM
head (BERT's block, at character level), trained with BERT's corruption: 15 %
of the characters chosen, 80 % of those replaced by a [MASK] id, 10 % by a
random character, 10 % kept. The loss is the cross-entropy on the chosen
positions only. Afterwards it fills in the masked characters of a sentence.

Defaults: d = 128, 4 heads, 4 blocks, 64 x 64 characters per batch, AdamW at
1e-3, 1500 steps (several minutes on a 2-core CPU); BLOCKLAB_TINY=1 shrinks
everything to a few seconds.
"""

import os

import jax
import jax.numpy as jnp
import optax

import blocklab as bl
from blocklab.models.encoder import EncoderModel
from blocklab.models.encoder_config import EncoderConfig
from blocklab.training.losses import mask_tokens, mlm_loss

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, heads, blocks, T, B, steps = (
    (16, 2, 1, 16, 8, 30) if tiny else (128, 4, 4, 64, 64, 1500)
)

data = bl.TimeMachine(seq_len=T, num_train=2000 if tiny else 100000, num_val=64)
V = data.vocab_size
MASK = V  # one id past the characters: the [MASK] token
cfg = EncoderConfig(
    V + 1, d, heads, blocks,
    norm="layer", norm_eps=1e-12, act="gelu_exact", placement="post", bias=True,
    positions="learned", max_len=T, embed_norm=True, final_norm=False,
    mlm_head=True,
)  # fmt: skip
model_key, data_key, fill_key = jax.random.split(jax.random.key(0), 3)
model = EncoderModel(cfg, key=model_key)
print(f"BERT-style encoder: {bl.count_params(model)} parameters")


def batch(key):
    """Corrupted windows and their labels (-100 where nothing is predicted)."""
    k_win, k_mask = jax.random.split(key)
    x, _ = data.train_batch(k_win, B)
    return mask_tokens(k_mask, x, mask_id=MASK, vocab_size=V)


def loss_fn(model, batch, key):
    inputs, labels = batch
    return mlm_loss(model, inputs, labels, key=key)


result = bl.train_model(
    model,
    batch,
    optax.adamw(1e-3, weight_decay=0.0),
    steps,
    key=data_key,
    loss_fn=loss_fn,
    run=bl.RunConfig(progress=False),
)
k = max(len(result.losses) // 3, 1)
print(
    f"MLM loss, first / last {k} steps: "
    f"{result.losses[:k].mean():.3f} / {result.losses[-k:].mean():.3f} "
    f"(uniform guess: {jnp.log(V):.3f})"
)

# Validation: the same corruption on the held-out windows.
x_val, _ = data.val_batch()
inputs, labels = mask_tokens(fill_key, x_val, mask_id=MASK, vocab_size=V)
print(f"validation MLM loss: {float(mlm_loss(result.model, inputs, labels)):.3f}")

# Fill in every fourth character of a held-out window.
x = x_val[0]
hidden = jnp.where(jnp.arange(T) % 4 == 1, MASK, x)
guess = jnp.argmax(result.model(hidden), axis=-1)
filled = jnp.where(hidden == MASK, guess, x)


def text(ids):
    return "".join("_" if int(i) == MASK else data.vocab[int(i)] for i in ids)


print("masked:  ", repr(text(hidden)))
print("filled:  ", repr(text(filled)))
print("original:", repr(text(x)))
