"""One model across devices: the cost of FSDP, and (on a GPU) the MFU of a Llama step.

1. **FSDP overhead.** The training step of a Llama-like `DecoderLM` (AdamW,
   float32) at one global batch, timed on 1 device (`train_model` without a
   mesh) and on 8 devices under `rules="fsdp"` (`train_model(...,
   run=RunConfig(mesh=...))`:
   parameters and Adam state split 8 ways, gathered per use, gradients
   reduce-scattered), in the same process, alternately. On a CPU the 8
   devices are simulated (`--xla_force_host_platform_device_count=8`, the
   script re-runs itself with it) and share the same cores, so the ratio
   measures the overhead of the partitioned program (collectives, smaller
   matrix products), not a speed-up. With fewer than 8 real accelerators it
   is skipped.
2. **MFU on a GPU** (when one is present): tokens per second of one
   device's bf16 step (`precision="bf16"`) of a Llama-architecture model of
   about 1 B parameters (TinyLlama-1.1B's shapes), as model FLOPs
   ($6N$ per token for the weights plus $6 L T d$ for causal attention
   scores and values, counted in full) over the device's published dense
   bf16 peak. The peers report 35-54 % (Levanter, GPU) and 60-70 % (MaxText,
   TPU) on much larger models and batches.

Usage: `python benchmarks/mesh.py [--steps 10]`. Prints a Markdown table and
one JSON line.
"""

from __future__ import annotations

import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

#: Dense bf16 peaks (FLOP/s) by device kind (vendor data sheets, no sparsity).
PEAKS = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L4": 121e12}


def _source(V: int, B: int, T: int):
    def draw(key):
        X = jax.random.randint(key, (B, T + 1), 0, V)
        return X[:, :-1], X[:, 1:]

    return draw


def _stepper(model, optimizer, source, steps, mesh=None, precision="float32"):
    """A callable running `steps` fused steps (one compiled chunk), blocking.

    The chunk is the one `train_model` runs (`run._run_chunk`, or on a mesh
    `mesh_training.run_chunk` with the state on its shardings), called directly so
    the timing holds no set-up (the state, the checks, the compile).
    """
    from blocklab.training import mesh_training as meshes
    from blocklab.training import run as train_run
    from blocklab.training import step as train_step

    step = train_step.make_train_step(optimizer, source, precision=precision)
    if mesh is None:
        # a copy: the chunk donates the state, the model stays usable
        fresh = jax.tree_util.tree_map(lambda a: a.copy(), model)
        box = [train_step.init_state(fresh, optimizer)]

        def chunk(state, keys):
            return train_run._run_chunk(step, state, keys)
    else:
        step = meshes.shard_step(step, mesh, "fsdp")
        state, shardings = meshes.sharded_state(model, optimizer, mesh, "fsdp")
        box = [state]

        def chunk(state, keys):
            return meshes.run_chunk((step, shardings), state, keys)

    key = jax.random.key(1)
    done = [0]

    def run():
        keys = train_step.step_keys(key, done[0], steps)
        box[0], losses = chunk(box[0], keys)
        done[0] += steps
        return np.asarray(losses)

    return run


def _time_runs(fns: dict, repeats: int) -> dict:
    best = {k: np.inf for k in fns}
    for _ in range(repeats):  # alternate, keep each one's best
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best


def fsdp_overhead(steps: int, repeats: int) -> dict:
    from blocklab.models.decoder import DecoderConfig, DecoderLM
    from blocklab.training.placement import mesh_of

    gpu = jax.devices()[0].platform != "cpu"
    d, L, B, T = (1024, 8, 64, 512) if gpu else (128, 2, 32, 64)
    cfg = DecoderConfig.llama(vocab_size=512, num_hiddens=d, num_heads=8,
                              num_kv_heads=4, num_blks=L, ffn_width=4 * d,
                              max_len=T)  # fmt: skip
    model = DecoderLM(cfg, key=jax.random.key(0))
    source = _source(cfg.vocab_size, B, T)
    optimizer = optax.adamw(1e-3)
    one = _stepper(model, optimizer, source, steps)
    eight = _stepper(model, optimizer, source, steps, mesh=mesh_of("data=8"))
    a, b = one(), eight()  # compile both; the same first steps
    same = float(np.max(np.abs(a - b) / np.abs(a)))
    best = _time_runs({"one": one, "fsdp8": eight}, repeats)
    return {
        "d": d, "layers": L, "batch": B, "seq_len": T, "steps": steps,
        "one_device_step_s": best["one"] / steps,
        "fsdp8_step_s": best["fsdp8"] / steps,
        "fsdp8_over_one": best["fsdp8"] / best["one"],
        "max_rel_loss_diff": same,
        "simulated": not gpu,
    }  # fmt: skip


def llama_mfu(steps: int, repeats: int, tiny: bool = False) -> dict:
    from blocklab.models.decoder import DecoderConfig, DecoderLM

    dev = jax.devices()[0]
    peak = next((v for k, v in PEAKS.items() if k in dev.device_kind), None)
    # TinyLlama-1.1B's shapes (Llama 2 architecture)
    V, d, L, H, KV, F, B, T = 32000, 2048, 22, 32, 4, 5632, 8, 2048
    if tiny:  # a smoke test of this code on a CPU
        V, d, L, H, KV, F, B, T = 256, 64, 2, 4, 2, 128, 2, 32
    cfg = DecoderConfig.llama(
        vocab_size=V,
        num_hiddens=d,
        num_heads=H,
        num_kv_heads=KV,
        num_blks=L,
        ffn_width=F,
        max_len=T,
    )
    model = DecoderLM(cfg, key=jax.random.key(0))
    n = sum(x.size for x in jax.tree_util.tree_leaves(model)
            if jax.numpy.issubdtype(x.dtype, jax.numpy.floating))  # fmt: skip
    n_emb = V * d  # the input embedding is a lookup, no FLOPs
    flops_per_token = 6 * (n - n_emb) + 6 * L * T * d

    run = _stepper(model, optax.adamw(1e-4), _source(V, B, T), steps,
                   precision="bf16")  # fmt: skip
    run()  # compile
    best = _time_runs({"step": run}, repeats)["step"] / steps
    tokens = B * T / best
    return {
        "device": dev.device_kind, "params": n, "batch": B, "seq_len": T,
        "step_s": best, "tokens_per_s": tokens,
        "model_tflops": flops_per_token * tokens / 1e12,
        "peak_tflops": None if peak is None else peak / 1e12,
        "mfu": None if peak is None else flops_per_token * tokens / peak,
    }  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tiny-mfu", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    platform = jax.devices()[0].platform
    if (
        platform == "cpu"
        and jax.device_count() < 8
        and not (args.child or args.tiny_mfu)
    ):
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS":
               "--xla_force_host_platform_device_count=8"}  # fmt: skip
        cmd = [sys.executable, os.path.abspath(__file__), "--child", *sys.argv[1:]]
        sys.exit(subprocess.run(cmd, env=env).returncode)
    out = {"platform": platform, "devices": jax.device_count()}
    if jax.device_count() >= 8 and not args.tiny_mfu:
        out["fsdp"] = f = fsdp_overhead(args.steps, args.repeats)
        print("| layout | step (ms) | ratio |\n|---|---|---|")
        print(f"| 1 device | {1e3 * f['one_device_step_s']:.1f} | 1.00 |")
        print(f"| fsdp, 8 {'simulated ' if f['simulated'] else ''}devices | "
              f"{1e3 * f['fsdp8_step_s']:.1f} | "
              f"{f['fsdp8_over_one']:.2f} |")  # fmt: skip
        print(
            f"(d={f['d']}, {f['layers']} layers, batch {f['batch']} x "
            f"{f['seq_len']}; losses agree to {f['max_rel_loss_diff']:.1e} relative)"
        )
    if platform == "gpu" or args.tiny_mfu:
        out["mfu"] = m = llama_mfu(args.steps, args.repeats, tiny=args.tiny_mfu)
        mfu = "n/a" if m["mfu"] is None else f"{100 * m['mfu']:.1f} %"
        print(f"\nLlama 1.1B bf16 step on one {m['device']}: {m['tokens_per_s']:.0f} "
              f"tokens/s, {m['model_tflops']:.0f} TFLOP/s, MFU {mfu} "
              "(Levanter 35-54 %, MaxText 60-70 % on TPU)")  # fmt: skip
    print(json.dumps(out))


if __name__ == "__main__":
    main()
