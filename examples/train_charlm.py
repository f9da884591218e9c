"""Train a character LM on The Time Machine, checkpoint it, reload it and sample text.

The chapter's protocol by default (d = 128, 4 heads, 2 blocks, 64 x 128
characters per batch, AdamW at 1e-3, 600 steps: a few minutes on a 2-core
CPU); BLOCKLAB_TINY=1 shrinks everything to a few seconds.
"""

import os
import tempfile
from pathlib import Path

import jax
import optax

import blocklab as bl

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, heads, blocks, T, B, steps = (
    (16, 2, 1, 16, 8, 20) if tiny else (128, 4, 2, 128, 64, 600)
)

data = bl.TimeMachine(
    seq_len=T, num_train=2000 if tiny else 100000, num_val=50 if tiny else 3000
)
model_key, data_key, sample_key = jax.random.split(jax.random.key(0), 3)
model = bl.CharLM(
    data.vocab_size, d, heads, blocks, act="swiglu", max_len=T, key=model_key
)
print(f"CharLM: {bl.count_params(model)} parameters")

result = bl.train_lm(
    model, data, optax.adamw(1e-3, weight_decay=0.0), steps, key=data_key, batch_size=B
)
k = len(result.losses) // 3
print(
    f"training loss, first / last {k} steps: "
    f"{result.losses[:k].mean():.3f} / {result.losses[-k:].mean():.3f}"
)
print(f"validation loss: {result.val_loss:.3f}")

with tempfile.TemporaryDirectory() as tmp:
    path = bl.save(Path(tmp) / "charlm.ckpt", result.model)
    restored = bl.load(path, like=result.model)  # refuses a different config
text = bl.generate_text(restored, data.vocab, "the time traveller", 60, key=sample_key)
print("sample:", repr(text))
