"""Rematerialization policies: bytes kept and step time, on a converted Llama.

A `transformers` `LlamaForCausalLM` with random weights (`--layers` 8,
`--width` 128, 4 query heads on 2 kv heads, vocab 512; reduced from the real
sizes so a CPU runs it in a few minutes) is converted with
`blocklab.from_huggingface`; for each policy (`blocklab.nn.remat`) the
training step's loss and gradient, `jax.jit(jax.value_and_grad)` of the
next-token loss on a batch of `--batch` x `--seq` (2048) tokens, is compiled
and:

- its `memory_analysis().temp_size_in_bytes`: the activations kept for the
  backward pass, plus the gradient buffers and the logits, which every
  policy shares (reported as "activation bytes" after subtracting the
  gradient bytes, the parameters' size);
- its time, the policies timed round-robin (`--reps` rounds, median).

Targets (issue 36), against `"none"` in the same run: `"dots"` keeps at most
70% of its activation bytes (saves >= 30%) at <= 1.15x its time; `"full"`
keeps at most 30% (saves >= 70%). The losses and gradients of every policy
equal `"none"`'s (checked, max |diff| printed).

Usage: `python benchmarks/remat.py [--seq 2048] [--width 128] [--layers 8]
[--reps 3] [--json]`.
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
import statistics  # noqa: E402
import time  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import blocklab  # noqa: E402
from blocklab.nn.remat import with_remat  # noqa: E402
from blocklab.training.losses import next_token_loss  # noqa: E402

POLICIES = ("none", "dots", "full", "nested", "names:mlp.hook_post")


def converted_llama(
    layers=8, width=128, heads=4, kv=2, vocab=512, max_len=2048, ffn=None
):
    """A random-weight `transformers` Llama, converted (needs torch)."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=width,
        intermediate_size=round(8 * width / 3) if ffn is None else ffn,
        num_attention_heads=heads, num_key_value_heads=kv,
        num_hidden_layers=layers, max_position_embeddings=max_len,
        vocab_size=vocab, tie_word_embeddings=False,
    )  # fmt: skip
    return blocklab.from_huggingface(transformers.LlamaForCausalLM(cfg).eval())


def compile_policy(model, ids, remat, precision="float32"):
    """The compiled `value_and_grad` of the next-token loss under `remat`."""
    model = with_remat(model, remat)
    params, static = eqx.partition(model, eqx.is_inexact_array)
    dtype = jnp.bfloat16 if precision == "bf16" else None

    def loss(p, ids):
        m = eqx.combine(p, static)
        if dtype is not None:
            m = jax.tree.map(
                lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a, m
            )
        return next_token_loss(m, (ids[:, :-1], ids[:, 1:]), None)

    compiled = jax.jit(jax.value_and_grad(loss)).lower(params, ids).compile()
    return compiled, params


def measure(model, ids, policies=POLICIES, reps=3, precision="float32") -> dict:
    """Per policy: temp bytes, activation bytes, median seconds, max |grad diff|."""
    out, fns = {}, {}
    grad_bytes = sum(
        x.size * 4 for x in jax.tree.leaves(eqx.filter(model, eqx.is_inexact_array))
    )
    ref = None
    for pol in policies:
        t0 = time.perf_counter()
        try:
            compiled, params = compile_policy(model, ids, pol, precision)
        except Exception as err:  # noqa: BLE001 - e.g. offload where unsupported
            out[pol] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            continue
        compile_s = time.perf_counter() - t0
        m = compiled.memory_analysis()
        loss, grads = compiled(params, ids)
        if ref is None:
            ref = (loss, grads)
        diff = max(
            float(jnp.max(jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32))))
            for a, b in zip(
                jax.tree.leaves(grads), jax.tree.leaves(ref[1]), strict=True
            )
        )
        temp = int(m.temp_size_in_bytes)
        out[pol] = {
            "temp_bytes": temp,
            "activation_bytes": temp - grad_bytes,
            "peak_bytes": int(getattr(m, "peak_memory_in_bytes", 0) or 0),
            "compile_s": compile_s,
            "loss": float(loss),
            "max_grad_diff_vs_first": diff,
        }
        fns[pol] = (compiled, params)
    policies = [p for p in policies if p in fns]
    times = {p: [] for p in policies}
    for _ in range(reps):
        for pol in policies:
            compiled, params = fns[pol]
            t0 = time.perf_counter()
            jax.block_until_ready(compiled(params, ids))
            times[pol].append(time.perf_counter() - t0)
    base = out[policies[0]]
    for pol in policies:
        out[pol]["seconds"] = statistics.median(times[pol])
        out[pol]["time_ratio"] = out[pol]["seconds"] / statistics.median(
            times[policies[0]]
        )
        out[pol]["activation_saved"] = 1 - (
            out[pol]["activation_bytes"] / base["activation_bytes"]
        )
    return out


def targets(res: dict) -> dict:
    dots, full = res.get("dots"), res.get("full")
    return {
        "dots saves >= 30%": None if dots is None else dots["activation_saved"] >= 0.3,
        "dots time <= 1.15x": None if dots is None else dots["time_ratio"] <= 1.15,
        "full saves >= 70%": None if full is None else full["activation_saved"] >= 0.7,
    }


def table(res: dict) -> str:
    mib = 2.0**20
    lines = [
        "| remat | activation MiB | saved vs none | temp MiB | s / step | x none |",
        "|---|---|---|---|---|---|",
    ]
    for pol, r in res.items():
        if "error" in r:
            lines.append(f"| `{pol}` | {r['error']} | | | | |")
            continue
        lines.append(
            f"| `{pol}` | {r['activation_bytes'] / mib:.1f} | "
            f"{100 * r['activation_saved']:.0f}% | {r['temp_bytes'] / mib:.1f} | "
            f"{r['seconds']:.3f} | {r['time_ratio']:.2f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    model = converted_llama(a.layers, a.width, max_len=a.seq)
    ids = jnp.asarray(
        np.random.default_rng(1).integers(0, 512, (a.batch, a.seq + 1)), jnp.int32
    )
    # the model's max_len bounds the inputs: the targets are the shifted ids
    res = measure(model, ids[:, : a.seq + 1], reps=a.reps)
    report = {
        "config": vars(a), "backend": jax.default_backend(), "policies": res,
        "targets": targets(res),
    }  # fmt: skip
    if a.json:
        print(json.dumps(report))
    else:
        print(table(res))
        print("targets:", report["targets"])
    return report


if __name__ == "__main__":
    main()
