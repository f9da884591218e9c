"""LoRA against full fine-tuning, and a sweep of adapters on one base against one run.

The model is a Llama converted from `transformers` (random weights from a
`LlamaConfig`, nothing downloads; a `DecoderConfig.llama` of the same shape
without `transformers`). Batches are random token ids drawn on the device.
Everything is measured in this process, each side against its reference:

1. **LoRA vs full fine-tuning.** Rank 8 on all seven projections
   (`blocklab.lora`, `lora_optimizer(optax.adamw)`) against AdamW on every
   weight, `train_model` for the same steps and batches. The optimizer
   state's bytes (the trained states' arrays) and the time per step (best of
   two runs of one compiled program; compile excluded) as ratios
   LoRA / full. Targets: state <= 2 %, step time <= 1.0.
2. **A sweep of K = 8 adapters on one base** (`train_sweep(base,
   adapters=...)`, 8 seeds) against one adapter run (the same call with
   K = 1): the compiled chunk's memory (`memory_analysis()`: arguments +
   outputs + temporaries - aliased; target <= 1.5x), split into the
   arguments (the base once, plus K adapters and their optimizer states) and
   each further member's temporaries (the activations of its own batch,
   which grow with K whatever holds the base), and the wall time
   against 8 `train_model` runs of the same adapters one after another
   (target >= 3x). Both sides are timed on a second run (compiled); the
   first runs' times are reported as compile + run.

Run: `python benchmarks/lora.py [--json] [--steps 10] [--hidden 512] ...`.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, where its signal.py
# would shadow the standard library's `signal` (imported by jax).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import optax  # noqa: E402

import blocklab as bl  # noqa: E402
from blocklab.nn.lora import lora_filter, lora_optimizer  # noqa: E402

PROJECTIONS = ["q", "k", "v", "o", "gate", "up", "down"]


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=1376)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--sweep-batch-size", type=int, default=2)
    p.add_argument("--sweep-seq-len", type=int, default=32)
    p.add_argument("--json", action="store_true")
    return p.parse_args()


def converted_llama(a: argparse.Namespace):
    """`(model, "converted from transformers" or "blocklab DecoderConfig")`."""
    try:
        import torch
        import transformers
    except ImportError:
        cfg = bl.DecoderConfig.llama(
            a.vocab, a.hidden, a.heads, a.layers, num_kv_heads=a.kv_heads,
            ffn_width=a.ffn, max_len=a.seq_len,
        )  # fmt: skip
        return bl.DecoderLM(cfg, key=jax.random.key(0)), "blocklab DecoderConfig"
    config = transformers.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        num_hidden_layers=a.layers, max_position_embeddings=a.seq_len,
    )  # fmt: skip
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config).eval()
    return bl.from_huggingface(hf), "converted from transformers"


def token_batches(vocab: int, batch: int, seq_len: int):
    def source(key):
        ids = jax.random.randint(key, (batch, seq_len + 1), 0, vocab)
        return ids[:, :-1], ids[:, 1:]

    return source


def nbytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def timed(fn):
    """`(first run's seconds (compile + run), best of two later runs, result)`."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    best = float("inf")
    for _ in range(2):  # best of two: the machine is shared
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return first, best, out


def lora_vs_full(a, base) -> dict:
    data = token_batches(a.vocab, a.batch_size, a.seq_len)
    adapted = bl.lora(
        base,
        bl.LoRAConfig(rank=a.rank, alpha=2.0 * a.rank, targets=PROJECTIONS),
        key=jax.random.key(1),
    )
    out = {}
    for name, model, opt in (
        ("full", base, optax.adamw(1e-4)),
        ("lora", adapted, lora_optimizer(optax.adamw(1e-3))),
    ):

        def run(model=model, opt=opt):
            r = bl.train_model(
                model,
                data,
                opt,
                a.steps,
                key=jax.random.key(2),
                run=bl.RunConfig(steps_per_call=a.steps, progress=False),
            )
            jax.block_until_ready(jax.tree.leaves(r.state.model))
            return r

        first, best, r = timed(run)
        out[name] = {
            "optimizer_state_bytes": nbytes(
                eqx.filter(r.state.opt_state, eqx.is_array)
            ),
            "step_s": best / a.steps,
            "first_run_s": first,
            "final_loss": float(r.losses[-1]),
        }
    out["params"] = nbytes(eqx.filter(base, eqx.is_inexact_array)) // 4
    out["adapter_params"] = nbytes(eqx.filter(adapted, lora_filter(adapted))) // 4
    out["optimizer_state_ratio"] = (
        out["lora"]["optimizer_state_bytes"] / out["full"]["optimizer_state_bytes"]
    )
    out["step_time_ratio"] = out["lora"]["step_s"] / out["full"]["step_s"]
    return out


def sweep_vs_runs(a, base) -> dict:
    K = a.members
    data = token_batches(a.vocab, a.sweep_batch_size, a.sweep_seq_len)
    spec = bl.LoRAConfig(rank=a.rank, alpha=2.0 * a.rank, targets=PROJECTIONS)

    def sweep(k, steps, memory=False):
        return bl.train_sweep(
            base,
            data,
            steps,
            model_keys=list(range(k)),
            data_keys=list(range(100, 100 + k)),
            run=bl.RunConfig(steps_per_call=steps, progress=False),
            sweep=bl.SweepConfig(
                learning_rates=1e-3,
                validate=False,
                adapters=spec,
                memory_analysis=memory,
            ),
        )

    mem1 = sweep(1, 1, memory=True).memory
    memK = sweep(K, 1, memory=True).memory
    # One optimizer object: train_model's compiled chunk is reused across runs.
    opt = lora_optimizer(optax.adamw(1e-3, weight_decay=0.0))

    def sequential():
        for k in range(K):
            start = bl.lora(
                base,
                bl.LoRAConfig(rank=a.rank, alpha=2.0 * a.rank, targets=PROJECTIONS),
                key=jax.random.key(k),
            )
            r = bl.train_model(
                start,
                data,
                opt,
                a.steps,
                key=jax.random.key(100 + k),
                run=bl.RunConfig(steps_per_call=a.steps, progress=False),
            )
            jax.block_until_ready(jax.tree.leaves(r.state.model))

    def swept():
        r = sweep(K, a.steps)
        jax.block_until_ready(jax.tree.leaves(r.state.model))

    seq_first, seq_best, _ = timed(sequential)
    sw_first, sw_best, _ = timed(swept)
    return {
        "members": K,
        "memory_bytes": {"K=1": mem1, f"K={K}": memK},
        "memory_ratio": memK["total"] / mem1["total"],
        # the arguments: the base once plus each member's adapters and state
        "argument_ratio": memK["argument"] / mem1["argument"],
        # each further member's temporaries (its own batch's activations)
        "temp_per_member_bytes": (memK["temp"] - mem1["temp"]) / max(1, K - 1),
        "base_bytes": nbytes(eqx.filter(base, eqx.is_array)),
        "sequential_s": seq_best,
        "sweep_s": sw_best,
        "sequential_first_run_s": seq_first,
        "sweep_first_run_s": sw_first,
        "speedup": seq_best / sw_best,
    }


def main() -> None:
    a = parse()
    base, source = converted_llama(a)
    out = {
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "cpu_cores": os.cpu_count(),
        "model": source,
        "config": vars(a),
        "lora_vs_full": lora_vs_full(a, base),
        "sweep": sweep_vs_runs(a, base),
    }
    if a.json:
        print(json.dumps(out))
        return
    lf, sw = out["lora_vs_full"], out["sweep"]
    print(
        f"{out['devices']}; Llama ({source}) d={a.hidden}, {a.layers} layers, "
        f"vocab {a.vocab}: {lf['params']} parameters, rank {a.rank} on all "
        f"projections: {lf['adapter_params']} adapter parameters\n"
    )
    print("| run | optimizer state (MiB) | step (ms) | compile + run (s) |")
    print("|---|---:|---:|---:|")
    for name in ("full", "lora"):
        r = lf[name]
        print(
            f"| {name} | {r['optimizer_state_bytes'] / 2**20:.2f} | "
            f"{1e3 * r['step_s']:.1f} | {r['first_run_s']:.1f} |"
        )
    print(
        f"\noptimizer state LoRA / full: {100 * lf['optimizer_state_ratio']:.2f}% "
        f"(target <= 2%); step time LoRA / full: {lf['step_time_ratio']:.2f} "
        "(target <= 1.0)\n"
    )
    K = sw["members"]
    m1, mK = sw["memory_bytes"]["K=1"], sw["memory_bytes"][f"K={K}"]
    print(f"| adapters on one base | chunk memory (MiB) | wall, {a.steps} steps (s) |")
    print("|---|---:|---:|")
    print(f"| 1 (train_sweep K=1) | {m1['total'] / 2**20:.1f} | |")
    print(f"| {K} sequential train_model | | {sw['sequential_s']:.2f} |")
    print(f"| train_sweep K={K} | {mK['total'] / 2**20:.1f} | {sw['sweep_s']:.2f} |")
    print(
        f"\nsweep memory / one adapter run: {sw['memory_ratio']:.2f}x (target <= "
        f"1.5x; arguments {sw['argument_ratio']:.2f}x, base "
        f"{sw['base_bytes'] / 2**20:.1f} MiB held once; each further member's "
        f"activations {sw['temp_per_member_bytes'] / 2**20:.1f} MiB); "
        f"sweep speed-up over {K} runs: {sw['speedup']:.2f}x (target >= 3x); "
        f"first runs (compile + run): sweep {sw['sweep_first_run_s']:.1f} s, "
        f"sequential {sw['sequential_first_run_s']:.1f} s"
    )


if __name__ == "__main__":
    main()
