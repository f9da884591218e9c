"""Load a checkpoint folder, fine-tune it with `train_model`, save it for transformers.

`python examples/finetune_pretrained.py [FOLDER]` reads FOLDER (written by
`transformers`' `save_pretrained`: config.json + safetensors) with
`blocklab.load_pretrained`, which never imports torch. Without FOLDER a small
random Llama checkpoint is written first (by `transformers` when it is
installed, else by blocklab itself; nothing downloads). The model is trained
for a few steps on The Time Machine's characters (ids below the model's
vocabulary), then `blocklab.save_pretrained` writes it back in the same
family, a folder that `transformers.AutoModelForCausalLM.from_pretrained`
loads; when `transformers` is installed the script checks that its logits
equal blocklab's. BLOCKLAB_TINY=1 shrinks everything to a few seconds.
"""

import os
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import optax

import blocklab as bl
from blocklab.interop import read_config

tiny = bool(os.environ.get("BLOCKLAB_TINY"))
d, layers, T, B, steps = (32, 2, 16, 4, 10) if tiny else (128, 4, 64, 16, 200)
VOCAB = 96  # > the 28 characters of The Time Machine


def make_checkpoint(folder: Path) -> Path:
    """A small random Llama checkpoint folder."""
    try:
        import torch
        import transformers
    except ImportError:
        cfg = bl.DecoderConfig.llama(VOCAB, d, 4, layers, num_kv_heads=2, max_len=T)
        return bl.save_pretrained(bl.DecoderLM(cfg, key=jax.random.key(0)), folder)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=3 * d,
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=layers,
        max_position_embeddings=T, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


with tempfile.TemporaryDirectory() as tmp:
    folder = (
        Path(sys.argv[1]) if len(sys.argv) > 1 else make_checkpoint(Path(tmp) / "in")
    )
    model = bl.load_pretrained(folder)
    family = read_config(folder)["architectures"][0]
    print(f"loaded {family} from {folder}: {bl.count_params(model)} parameters")

    data = bl.TimeMachine(seq_len=T, num_train=2000 if tiny else 50000, num_val=50)
    result = bl.train_model(
        model,
        data,
        optax.adamw(1e-3),
        steps,
        key=jax.random.key(1),
        run=bl.RunConfig(batch_size=B, progress=False),
    )
    k = max(1, len(result.losses) // 3)
    print(
        f"fine-tuned {steps} steps: loss {result.losses[:k].mean():.3f} -> "
        f"{result.losses[-k:].mean():.3f} (validation {result.val_loss:.3f})"
    )

    out = bl.save_pretrained(result.model, Path(tmp) / "out", family=family)
    print("written:", sorted(p.name for p in out.iterdir()))
    ids = np.array(data.val_batch()[0][:2])
    ours = np.asarray(result.model(ids))
    try:
        import torch
        import transformers
    except ImportError:
        print("(transformers not installed: the transformers check is skipped)")
    else:
        back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
        with torch.no_grad():
            theirs = back(torch.as_tensor(ids)).logits.numpy()
        scale, diff = np.abs(theirs).max(), np.abs(ours - theirs).max()
        print(
            f"transformers loads it: max |logits diff| = {diff:.1e} (max {scale:.1f})"
        )
        assert diff <= 1e-4 * scale
