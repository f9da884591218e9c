"""Sample from a converted `transformers` model with `blocklab.generate`.

Nothing is downloaded: a small Gemma 3 (local layers with a sliding window,
a global layer, grouped-query heads) is built from a config with random
weights and converted with `blocklab.from_huggingface`. The script then

1. decodes greedily and checks the tokens against `transformers`' own
   `generate(do_sample=False)`, with the total length past the window;
2. samples ragged prompts (right-padded, with `lengths=`) at a temperature,
   with top-k and top-p, and an end-of-sequence id;
3. steps the cache by hand (`init_cache`, `prefill`, `decode_step`) and
   compares its logits with the uncached model's.

Needs torch and transformers (`python3 -m pip install -e ".[test]"`).
`BLOCKLAB_TINY=1` (the examples test) keeps it to a few seconds of compute.
"""

import os

import equinox as eqx
import jax
import numpy as np

import blocklab

try:
    import torch
    import transformers
except ImportError:  # the example needs the optional test extra
    print(
        "generate_converted.py needs torch and transformers: pip install -e '.[test]'"
    )
    raise SystemExit(0) from None

TINY = os.environ.get("BLOCKLAB_TINY") == "1"
VOCAB, WINDOW = 96, 4
NEW = 8 if TINY else 24

config = transformers.Gemma3TextConfig(
    vocab_size=VOCAB,
    hidden_size=32 if TINY else 64,
    intermediate_size=48 if TINY else 128,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    head_dim=8 if TINY else 16,
    num_hidden_layers=2,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=WINDOW,
    max_position_embeddings=64,
    bos_token_id=0,
    eos_token_id=1,
    pad_token_id=0,
    attn_implementation="eager",
)
torch.manual_seed(0)
hf = transformers.Gemma3ForCausalLM(config).eval()
with torch.no_grad():  # random weights of real size (continuations vary)
    for name, p in hf.named_parameters():
        scale = 0.02 if "embed" in name else 0.3
        p.mul_(0).add_(scale * torch.randn(p.shape))
model = blocklab.from_huggingface(hf)

# 1. Greedy decoding, token for token against transformers.
prompts = np.random.default_rng(0).integers(2, VOCAB, (2, 6))
ours = np.asarray(blocklab.generate(model, prompts, NEW))
with torch.no_grad():
    ref = hf.generate(
        torch.as_tensor(prompts),
        attention_mask=torch.ones(2, 6, dtype=torch.long),
        max_new_tokens=NEW,
        do_sample=False,
        eos_token_id=None,
    ).numpy()
print(f"greedy, {6 + NEW} tokens (window {WINDOW}):")
for row in ours:
    print("  ", " ".join(map(str, row)))
print("same tokens as transformers:", bool(np.array_equal(ours, ref)))
assert np.array_equal(ours, ref)

# 2. Sampling ragged prompts: row b holds lengths[b] prompt tokens, then its
# new tokens, then padding (the eos id here).
lengths = np.array([6, 3])
sampled = blocklab.generate(
    model,
    prompts,
    NEW,
    key=jax.random.key(0),
    config=blocklab.GenerationConfig(temperature=0.8, top_k=20, top_p=0.9, eos_id=1),
    lengths=lengths,
)
print("sampled (temperature 0.8, top-k 20, top-p 0.9, eos 1):")
for row, n in zip(np.asarray(sampled), lengths, strict=True):
    print(f"   prompt {row[:n].tolist()} -> {row[n : n + NEW].tolist()}")

# 3. The cache by hand: prefill, then one token per step.
prefill = eqx.filter_jit(lambda m, ids, c: m.prefill(ids, c))
decode_step = eqx.filter_jit(lambda m, token, c: m.decode_step(token, c))
seq = np.asarray(ours[0])
cache = model.init_cache((), max_len=len(seq))
logits, cache = prefill(model, seq[:6], cache)
steps = [logits]
for token in seq[6:-1]:  # position 6, 7, ...: each from the cache's length
    step, cache = decode_step(model, token, cache)
    steps.append(step[None])
cached = np.concatenate(steps)
full = np.asarray(model(seq[:-1]))
err = np.abs(cached - full).max() / np.abs(full).max()
print(f"cached vs uncached logits: max |diff| / max |logit| = {err:.1e}")
assert err <= 1e-5
