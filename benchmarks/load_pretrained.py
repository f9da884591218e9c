"""Loading a checkpoint folder: `blocklab.load_pretrained` vs transformers + convert.

A Llama-style checkpoint of about `--size` MB (float32; 200 MB on a CPU,
1000 MB on an accelerator) is written once by `transformers`' own
`save_pretrained` (random weights, nothing downloads; without torch, by
`blocklab.save_pretrained`). Then, each in a fresh subprocess so that its
resident memory is its own:

1. blocklab: `blocklab.load_pretrained(folder)` (torch never imported),
   every parameter ready on the default device;
2. reference: `transformers.AutoModelForCausalLM.from_pretrained(folder)`
   followed by `blocklab.from_huggingface(model)`, the way to a JAX model
   without `load_pretrained`.

Each child reports its wall time (the call, imports excluded), its resident
memory before the call (after importing and starting JAX's runtime, which
any JAX program pays) and its peak (`VmHWM`). Memory is reported as the
peak's increase over the RSS before the call, in units of the checkpoint's
bytes: the parameters themselves are 1.0 (on a CPU the device memory is host
memory); the rest is the tensor in flight plus a fixed part (about 80 MB on a
CPU: XLA's compiled in-place updates, one per parameter shape). Targets
(issue 20): blocklab faster and lighter than the reference, and its increase
at most about 1.5x the checkpoint.

Prints human-readable lines, then one JSON line. Usage:
`python benchmarks/load_pretrained.py [--size MB] [--reps 2] [--only-blocklab]`.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, and its `signal.py`
# would shadow the standard library's `signal` module (imported by jax).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

D, HEADS, KV, FFN, VOCAB = 512, 8, 4, 1408, 8192


def _layers(size_mb: float) -> int:
    """Layers so that the float32 checkpoint is about `size_mb` MB."""
    per_layer = 2 * D * D + 2 * D * (D // HEADS) * KV + 3 * D * FFN + 2 * D
    fixed = 2 * VOCAB * D + D
    return max(1, round((size_mb * 1e6 / 4 - fixed) / per_layer))


def make_checkpoint(folder: Path, size_mb: float) -> str:
    """Write the checkpoint; returns who wrote it."""
    layers = _layers(size_mb)
    try:
        import torch
        import transformers
    except ImportError:
        torch = None
    if torch is not None:
        config = transformers.LlamaConfig(
            vocab_size=VOCAB, hidden_size=D, intermediate_size=FFN,
            num_attention_heads=HEADS, num_key_value_heads=KV,
            num_hidden_layers=layers, max_position_embeddings=512,
            bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(0)
        transformers.LlamaForCausalLM(config).save_pretrained(folder)
        return "transformers"
    import jax

    import blocklab

    cfg = blocklab.DecoderConfig.llama(
        VOCAB, D, HEADS, layers, num_kv_heads=KV, ffn_width=FFN, max_len=512,
        tie_embeddings=False,
    )  # fmt: skip
    blocklab.save_pretrained(blocklab.DecoderLM(cfg, key=jax.random.key(0)), folder)
    return "blocklab"


CHILD = r"""
import json, resource, sys, time
which, folder = sys.argv[1], sys.argv[2]

def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 1e6

import jax, numpy as np
import blocklab
if which == "transformers":
    import torch, transformers
    torch.set_num_threads(max(1, torch.get_num_threads()))
jax.block_until_ready(jax.numpy.zeros(8) + 1)  # the runtime: any JAX program pays it
before = rss_mb()
t0 = time.perf_counter()
if which == "blocklab":
    model = blocklab.load_pretrained(folder)
else:
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model = blocklab.from_huggingface(hf)
jax.block_until_ready(jax.tree_util.tree_leaves(model))
wall = time.perf_counter() - t0
# VmHWM: this address space's peak (ru_maxrss would carry the parent's over exec)
with open("/proc/self/status") as f:
    peak = next(int(l.split()[1]) for l in f if l.startswith("VmHWM:")) * 1024 / 1e6
print(json.dumps(dict(wall_s=wall, rss_before_mb=before, peak_mb=peak,
                      torch_imported="torch" in sys.modules)))
"""


def child(which: str, folder: Path) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, which, str(folder)],
        capture_output=True, text=True, timeout=1800,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"{which} child failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    import jax

    platform = jax.devices()[0].platform
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--size", type=float, default=200 if platform == "cpu" else 1000
    )
    parser.add_argument("--reps", type=int, default=2, help="children per side")
    parser.add_argument("--only-blocklab", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "ckpt"
        writer = make_checkpoint(folder, args.size)
        nbytes = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        sides = ["blocklab"] + ([] if args.only_blocklab else ["transformers"])
        runs = {s: [] for s in sides}
        for _ in range(args.reps):  # round-robin: both sides see the same load
            for s in sides:
                runs[s].append(child(s, folder))
    mb = nbytes / 1e6
    result = dict(
        platform=platform, checkpoint_mb=round(mb, 1), layers=_layers(args.size),
        written_by=writer, reps=args.reps,
    )  # fmt: skip
    for s, rs in runs.items():
        best = min(rs, key=lambda r: r["wall_s"])
        over = max(r["peak_mb"] - r["rss_before_mb"] for r in rs)
        result[f"{s}_wall_s"] = round(best["wall_s"], 3)
        result[f"{s}_peak_mb"] = round(max(r["peak_mb"] for r in rs), 1)
        result[f"{s}_rss_increase_mb"] = round(over, 1)
        result[f"{s}_rss_over_bytes"] = round(over / mb, 3)
        result[f"{s}_torch_imported"] = any(r["torch_imported"] for r in rs)
        print(
            f"{s:>12}: {best['wall_s']:.2f} s, peak RSS {result[f'{s}_peak_mb']:.0f} MB"
            f" (+{over:.0f} MB over the RSS before the call = "
            f"{over / mb:.2f}x the {mb:.0f} MB checkpoint)"
        )
    if "transformers" in runs:
        result["time_ratio_reference_over_blocklab"] = round(
            result["transformers_wall_s"] / result["blocklab_wall_s"], 2
        )
        result["memory_ratio_reference_over_blocklab"] = round(
            result["transformers_rss_increase_mb"] / result["blocklab_rss_increase_mb"],
            2,
        )
        t = result["time_ratio_reference_over_blocklab"]
        m = result["memory_ratio_reference_over_blocklab"]
        print(f"reference / blocklab: time {t}x, memory increase {m}x")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
