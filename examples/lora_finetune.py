"""Fine-tune a converted Llama with LoRA and fully, then hand the adapter to PEFT.

`python examples/lora_finetune.py` builds a small Llama with random weights
from a `transformers.LlamaConfig` (nothing downloads), converts it with
`blocklab.from_huggingface`, and fine-tunes it on The Time Machine's
characters for the same number of steps twice:

- fully (AdamW on every weight);
- with rank-8 adapters on every projection (`blocklab.lora`, AdamW on the
  adapters only through `lora_optimizer`).

It prints each run's validation loss, the optimizer state's bytes and the
time per step (compile excluded: the second of two runs of one compiled
program). It then saves the adapter with `blocklab.save_adapter`, loads it
into the `transformers` model with `peft.PeftModel.from_pretrained` and
checks that PEFT's greedy tokens equal blocklab's, and that
`blocklab.load_adapter` reads the folder back. Without `transformers` the
model is a `DecoderConfig.llama` and the PEFT part is skipped.
BLOCKLAB_TINY=1 shrinks everything to a few seconds.
"""

import os
import tempfile
import time
from pathlib import Path

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax

import blocklab as bl
from blocklab.nn.lora import lora_optimizer

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, layers, T, B, steps = (32, 2, 16, 4, 6) if tiny else (128, 4, 64, 16, 300)
VOCAB = 96  # > the 28 characters of The Time Machine
PROJECTIONS = ["q", "k", "v", "o", "gate", "up", "down"]

try:
    import torch
    import transformers
except ImportError:
    torch = transformers = None


def make_model():
    """`(blocklab model, transformers model or None)`, the same weights."""
    if transformers is None:
        cfg = bl.DecoderConfig.llama(VOCAB, d, 4, layers, num_kv_heads=2, max_len=T)
        return bl.DecoderLM(cfg, key=jax.random.key(0)), None
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=3 * d,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
        max_position_embeddings=2 * T, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    return bl.from_huggingface(hf), hf


def nbytes(tree) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))


def fine_tune(model, optimizer, data):
    """`(result, seconds per step)`: the step time of a second run (compiled)."""

    def run():
        return bl.train_model(
            model,
            data,
            optimizer,
            steps,
            key=jax.random.key(1),
            run=bl.RunConfig(batch_size=B, steps_per_call=steps, progress=False),
        )

    result = run()  # compiles
    t0 = time.perf_counter()
    jax.block_until_ready(run().losses)
    return result, (time.perf_counter() - t0) / steps


model, hf = make_model()
data = bl.TimeMachine(seq_len=T, num_train=2000 if tiny else 50000, num_val=50)
print(f"Llama: {bl.count_params(model)} parameters, {layers} layers, width {d}")

full, full_step = fine_tune(model, optax.adamw(1e-3), data)
adapted = bl.lora(
    model, bl.LoRAConfig(rank=8, alpha=16.0, targets=PROJECTIONS), key=jax.random.key(2)
)
tuned, lora_step = fine_tune(adapted, lora_optimizer(optax.adamw(3e-3)), data)

rows = [
    ("full fine-tuning", full, full_step),
    ("LoRA r=8, all projections", tuned, lora_step),
]
print(f"\n{steps} steps of batch {B} x {T}:\n")
print("| run | validation loss | optimizer state (KiB) | ms / step |")
print("|---|---:|---:|---:|")
for name, r, per_step in rows:
    state_kib = nbytes(eqx.filter(r.state.opt_state, eqx.is_array)) / 1024
    print(f"| {name} | {r.val_loss:.3f} | {state_kib:.1f} | {1e3 * per_step:.2f} |")
ratio = nbytes(eqx.filter(tuned.state.opt_state, eqx.is_array)) / nbytes(
    eqx.filter(full.state.opt_state, eqx.is_array)
)
print(f"\nLoRA's optimizer state is {100 * ratio:.2f}% of full fine-tuning's.")

prompt = np.array(data.val_batch()[0][0][:8])
new = 12
ours = np.asarray(bl.generate(tuned.model, jnp.asarray(prompt), new))
with tempfile.TemporaryDirectory() as tmp:
    folder = bl.save_adapter(tuned.model, Path(tmp) / "adapter")
    print("adapter written:", sorted(p.name for p in folder.iterdir()))
    back = bl.load_adapter(model, folder)
    same = np.array_equal(np.asarray(bl.generate(back, jnp.asarray(prompt), new)), ours)
    print("blocklab.load_adapter gives the same tokens:", same)
    assert same
    try:
        import peft
    except ImportError:
        peft = None
    if hf is None or peft is None:
        print("(transformers or peft not installed: the PEFT check is skipped)")
    else:
        peft_model = peft.PeftModel.from_pretrained(hf, folder).eval()
        # blocklab.generate without eos_id never stops early; so that greedy
        # decoding is the same rule on both sides, transformers must not stop
        # at (or, with min_new_tokens, forbid) its eos id either
        hf.generation_config.eos_token_id = None
        with torch.no_grad():
            theirs = peft_model.generate(
                torch.tensor(prompt)[None], max_new_tokens=new, do_sample=False,
                pad_token_id=0,
            )[0].numpy()  # fmt: skip
        print("PEFT's greedy tokens:    ", theirs[len(prompt) :].tolist())
        print("blocklab's greedy tokens:", ours[len(prompt) :].tolist())
        assert np.array_equal(theirs, ours), (theirs, ours)
        print("PEFT generates the same tokens.")
