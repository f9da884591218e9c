"""Convert a small random Llama from `transformers` and inspect it with blocklab.

Nothing is downloaded: the PyTorch model is built from a config with random
weights. The script converts it with `blocklab.from_huggingface`, checks the
logits against PyTorch's, and runs `blocklab.signal_stats` on the converted
stack (per block: stream RMS, token spread, attention entropy, largest logit,
gradient norms of the four attention projections).

Needs torch and transformers (`python3 -m pip install -e ".[test]"`).
"""

import math

import jax
import numpy as np

import blocklab

try:
    import torch
    import transformers
except ImportError:  # the example needs the optional test extra
    print("convert_llama.py needs torch and transformers: pip install -e '.[test]'")
    raise SystemExit(0) from None

VOCAB, T = 128, 32

config = transformers.LlamaConfig(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=172,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention
    num_hidden_layers=4,
    max_position_embeddings=T,
    bos_token_id=0,
    eos_token_id=0,
    attn_implementation="eager",
)
torch.manual_seed(0)
hf = transformers.LlamaForCausalLM(config).eval()

model = blocklab.from_huggingface(hf)
print("blocklab config:", model.cfg)

ids = np.random.default_rng(0).integers(0, VOCAB, (2, T))
with torch.no_grad():
    ref = hf(torch.as_tensor(ids)).logits.numpy()
ours = np.asarray(model(ids))
print(
    f"logits vs PyTorch: max |diff| = {np.abs(ours - ref).max():.2e} "
    f"(max |logit| = {np.abs(ref).max():.2e})"
)

# Diagnostics on the converted stack, fed standard-normal tokens.
X = jax.random.normal(jax.random.key(0), (2, T, config.hidden_size))
stats = blocklab.signal_stats(model.stack, X)
print(f"\nper block (uniform attention entropy: log T = {math.log(T):.2f})")
header = ("block", "RMS", "spread", "entropy", "max logit", "|dW_q|", "|dW_v|")
print("  ".join(f"{h:>9}" for h in header))
for k in range(model.cfg.num_blks):
    row = (
        stats.stream_rms[k],
        stats.token_spread[k],
        stats.attn_entropy[k],
        stats.max_logit[k],
        stats.grad_norms["W_q"][k],
        stats.grad_norms["W_v"][k],
    )
    print(f"{k + 1:>9}  " + "  ".join(f"{float(v):9.3g}" for v in row))
