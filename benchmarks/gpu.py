"""Every figure that needs an accelerator, in one command (issue 36).

Run this first when a GPU is lent, before anything else uses the device:
`python benchmarks/gpu.py --out gpu.json` (about 5-8 minutes on one H200).
Each section is timed and guarded: one that fails, or would start past the
`--budget` seconds, is recorded as such and the others still run. It writes
one JSON file (`--out`) and prints a README-ready Markdown table (also
written beside the JSON, `.md`).

1. **Attention, forward + backward**: one causal attention layer
   (`MultiHeadAttention` of a `TransformerBlock`, d = 1024, 16 heads,
   batch 1, bfloat16 on a GPU), `"fused"` (cuDNN where it takes the call)
   against `"reference"` (full logits), and `"chunked"`, at T = 1k .. 16k;
   the reference only up to 8k (its logits grow as T^2).
2. **Training-step MFU per remat policy**: a Llama (the converted
   `transformers` model when torch is importable on the machine, else the
   same shapes built in blocklab; d = 2048, 16 layers, 16 heads on 4 kv
   heads, FFN 5632, vocab 32000: TinyLlama's shapes), batch 4 x 2048,
   bfloat16 compute, `jax.value_and_grad` of the next-token loss: model
   FLOPs (`blocklab.training.plan.step_flops(..., "none")`: recomputation
   not counted, as MFU counts) over time, divided by the bfloat16 matmul
   peak measured in the same run; and each policy's temporaries.
3. **Decoding**: tokens per second of `blocklab.generate` (greedy, batch 8,
   32 new tokens) after prompts of 128, 2048 and 8192 tokens, the prefill's
   time (a run with 1 new token) subtracted (`None` where the difference is
   not positive: timing noise at tiny sizes).
4. **Sweep against sequential runs**: `train_sweep` of 8 CharLMs against 8
   sequential `train_lm` runs, the same steps (compiled first, best of 2).

`--smoke` runs every section at tiny sizes (any backend, a CPU in about a
minute): what the test suite runs to keep the script working.
"""

from __future__ import annotations

import os
import sys

# Run as a script, this folder comes first on sys.path, where its signal.py
# would shadow the standard library's `signal` (imported by jax).
_here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]

import argparse  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import blocklab  # noqa: E402
from blocklab.experiments.timing import matmul_peak_flops  # noqa: E402
from blocklab.training.plan import step_flops  # noqa: E402


def _remat_bench():
    """benchmarks/remat.py as a module (it shares the policy measurement)."""
    spec = importlib.util.spec_from_file_location(
        "_remat_bench", os.path.join(_here, "remat.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


SIZES = {
    "full": dict(
        attn_d=1024, attn_heads=16, attn_lens=(1024, 2048, 4096, 8192, 16384),
        ref_max=8192, llama=dict(d=2048, layers=16, heads=16, kv=4, ffn=5632,
        vocab=32000), batch=4, seq=2048, policies=("none", "dots", "full",
        "nested"), decode_lens=(128, 2048, 8192), decode_d=1024,
        decode_layers=8, decode_batch=8, new=32, sweep=dict(members=8, steps=100,
        d=256, blks=4, batch=64, seq=128), reps=5,
    ),
    "smoke": dict(
        attn_d=32, attn_heads=4, attn_lens=(64, 128), ref_max=128,
        llama=dict(d=32, layers=2, heads=4, kv=2, ffn=64, vocab=64), batch=2,
        seq=64, policies=("none", "dots", "full", "nested"),
        decode_lens=(16, 32), decode_d=32, decode_layers=2, decode_batch=2,
        new=4, sweep=dict(members=2, steps=4, d=16, blks=1, batch=4, seq=16),
        reps=1,
    ),
}  # fmt: skip


def _dtype():
    return jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32


def _median_time(fn, reps):
    jax.block_until_ready(fn())  # compile
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def attention_section(s: dict) -> dict:
    """Forward + backward seconds per implementation and length."""
    dtype = _dtype()
    block = blocklab.TransformerBlock(
        s["attn_d"], s["attn_heads"], key=jax.random.key(0)
    )
    attn = jax.tree.map(lambda a: a.astype(dtype) if eqx.is_inexact_array(a) else a,
                        block.attention)  # fmt: skip
    rows = []
    for T in s["attn_lens"]:
        x = jax.random.normal(jax.random.key(1), (1, T, s["attn_d"]), dtype)
        lens = jnp.arange(1, T + 1)
        row = {"T": T}
        for impl in ("fused", "chunked", "reference"):
            if impl == "reference" and T > s["ref_max"]:
                row[impl] = None
                continue

            @jax.jit
            def step(x, lens, impl=impl):
                def f(x):
                    out = attn(x, lens, impl=impl)
                    return jnp.sum(out.astype(jnp.float32) ** 2)

                return jax.grad(f)(x)

            try:
                run = lambda step=step, x=x, lens=lens: step(x, lens)  # noqa: E731
                row[impl] = _median_time(run, s["reps"])
            except Exception as err:  # noqa: BLE001 - recorded, the rest runs
                row[impl] = f"failed: {type(err).__name__}: {str(err)[:200]}"
        if isinstance(row.get("fused"), float) and isinstance(
            row.get("reference"), float
        ):
            row["reference_over_fused"] = row["reference"] / row["fused"]
        rows.append(row)
    return {"dtype": str(jnp.dtype(dtype)), "d": s["attn_d"], "heads": s["attn_heads"],
            "rows": rows}  # fmt: skip


def _llama(spec: dict, max_len: int):
    """The converted Llama when torch is there, else the same in blocklab."""
    try:
        bench = _remat_bench()
        model = bench.converted_llama(
            spec["layers"], spec["d"], spec["heads"], spec["kv"], spec["vocab"],
            max_len, ffn=spec["ffn"],
        )  # fmt: skip
        return model, "converted from transformers"
    except ImportError:
        cfg = blocklab.DecoderConfig.llama(
            vocab_size=spec["vocab"], num_hiddens=spec["d"], num_heads=spec["heads"],
            num_blks=spec["layers"], num_kv_heads=spec["kv"], ffn_width=spec["ffn"],
            max_len=max_len,
        )  # fmt: skip
        return blocklab.DecoderLM(cfg, key=jax.random.key(0)), "built in blocklab"


def mfu_section(s: dict) -> dict:
    """Per remat policy: seconds, MFU and temporaries of the bf16 step."""
    bench = _remat_bench()
    model, origin = _llama(s["llama"], s["seq"])
    B, T = s["batch"], s["seq"]
    ids = jax.random.randint(jax.random.key(2), (B, T + 1), 0, s["llama"]["vocab"])
    gpu = jax.default_backend() == "gpu"
    precision = "bf16" if gpu else "float32"
    policies = list(s["policies"])
    if gpu:  # host offload exists there (recorded as an error if refused)
        policies.append("offload:mlp.hook_post,attn.hook_q,attn.hook_k,attn.hook_v")
    res = bench.measure(model, ids, policies, reps=s["reps"], precision=precision)
    n = 8192 if jax.default_backend() == "gpu" else 512
    peak = matmul_peak_flops(n, dtype=_dtype(), reps=5)
    flops = step_flops(model.cfg, B, T, "none") * (T + 1) / T
    for r in res.values():
        if "seconds" in r:
            r["mfu"] = flops / r["seconds"] / peak
    return {"model": origin, "batch": B, "seq": T, "precision": precision,
            "peak_flops": peak, "model_flops": flops, "policies": res}  # fmt: skip


def decode_section(s: dict) -> dict:
    """Decode tokens/s after prompts of each length (prefill subtracted)."""
    L = max(s["decode_lens"]) + s["new"] + 1
    cfg = blocklab.DecoderConfig.llama(
        vocab_size=1000, num_hiddens=s["decode_d"],
        num_heads=8 if s["decode_d"] >= 64 else 2, num_blks=s["decode_layers"],
        num_kv_heads=2, max_len=L,
    )  # fmt: skip
    model = blocklab.DecoderLM(cfg, key=jax.random.key(0))
    model = jax.tree.map(
        lambda a: a.astype(_dtype()) if eqx.is_inexact_array(a) else a, model
    )
    rows = []
    for P in s["decode_lens"]:
        ids = jax.random.randint(jax.random.key(3), (s["decode_batch"], P), 0, 1000)

        def gen(n, ids=ids):
            return blocklab.generate(model, ids, n)

        t_new = _median_time(lambda: gen(s["new"]), s["reps"])  # noqa: B023
        t_one = _median_time(lambda: gen(1), s["reps"])  # noqa: B023
        steps, decode_s = s["new"] - 1, t_new - t_one
        rate = s["decode_batch"] * steps / decode_s if decode_s > 0 else None
        rows.append({"prompt": P, "seconds": t_new, "prefill_s": t_one,
                     "decode_tokens_per_s": rate})  # fmt: skip
    return {"batch": s["decode_batch"], "new": s["new"], "rows": rows}


def sweep_section(s: dict) -> dict:
    """train_sweep of K members against K sequential train_lm runs."""
    p = s["sweep"]
    data = blocklab.TimeMachine(seq_len=p["seq"], num_val=0)
    K, optimizer = p["members"], optax.adamw(1e-3, weight_decay=0.0)

    def make_model(key):
        return blocklab.CharLM(data.vocab_size, p["d"], 4, p["blks"], max_len=p["seq"],
                               key=key)  # fmt: skip

    def sequential():
        for k in range(K):
            blocklab.train_lm(
                make_model(jax.random.key(k)), data, optimizer, p["steps"],
                key=jax.random.key(100 + k), batch_size=p["batch"],
                steps_per_call=p["steps"], progress=False,
            )  # fmt: skip

    def sweep():
        blocklab.train_sweep(
            make_model,
            data,
            p["steps"],
            model_keys=list(range(K)),
            data_keys=list(range(100, 100 + K)),
            run=blocklab.RunConfig(
                batch_size=p["batch"], steps_per_call=p["steps"], progress=False
            ),
            sweep=blocklab.SweepConfig(learning_rates=1e-3, validate=False),
        )

    times = {}
    for name, fn in (("sequential", sequential), ("sweep", sweep)):
        fn()
        best = float("inf")
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    return {**p, "sequential_s": times["sequential"], "sweep_s": times["sweep"],
            "speedup": times["sequential"] / times["sweep"]}  # fmt: skip


SECTIONS = {
    "attention": attention_section,
    "mfu": mfu_section,
    "decode": decode_section,
    "sweep": sweep_section,
}


def _fmt(v, spec=".3g"):
    return format(v, spec) if isinstance(v, float) else ("-" if v is None else str(v))


def markdown(report: dict) -> str:
    """The README-ready table: one row per figure."""
    dev = report["device"]
    lines = [f"Device: {dev} (jax {report['jax']}); every ratio within one run.", "",
             "| figure | setting | measured |", "|---|---|---|"]  # fmt: skip
    sec = report["sections"]
    a = sec.get("attention", {})
    for row in a.get("rows", []):
        lines.append(
            f"| attention fwd+bwd, {a['dtype']} | T = {row['T']} | fused "
            f"{_fmt(row.get('fused'))} s, chunked {_fmt(row.get('chunked'))} s, "
            f"reference {_fmt(row.get('reference'))} s (reference / fused "
            f"{_fmt(row.get('reference_over_fused'))}) |"
        )
    m = sec.get("mfu", {})
    for pol, r in m.get("policies", {}).items():
        if "mfu" not in r:
            lines.append(f"| Llama step | remat `{pol}` | {r.get('error')} |")
            continue
        lines.append(
            f"| Llama step MFU ({m['model']}, {m['precision']}) | batch {m['batch']} x "
            f"{m['seq']}, remat `{pol}` | {100 * r['mfu']:.1f}% ({r['seconds']:.3f} s, "
            f"temp {r['temp_bytes'] / 2**30:.2f} GiB, x{r['time_ratio']:.2f} none) |"
        )
    d = sec.get("decode", {})
    for row in d.get("rows", []):
        lines.append(
            f"| decode, batch {d['batch']} | prompt {row['prompt']} | "
            f"{_fmt(row['decode_tokens_per_s'], '.0f')} tokens/s |"
        )
    w = sec.get("sweep", {})
    if "speedup" in w:
        lines.append(
            f"| sweep vs sequential | K = {w['members']}, {w['steps']} steps, "
            f"d = {w['d']} | {w['speedup']:.2f}x ({w['sweep_s']:.2f} s vs "
            f"{w['sequential_s']:.2f} s) |"
        )
    for name, s in sec.items():
        if "error" in s or "skipped" in s:
            lines.append(f"| {name} | - | {s.get('error') or s.get('skipped')} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, any backend")
    ap.add_argument("--out", default="gpu_figures.json", help="the JSON file")
    ap.add_argument(
        "--budget", type=float, default=450.0,
        help="seconds: a section that would start later is skipped",
    )  # fmt: skip
    ap.add_argument("--only", nargs="+", choices=list(SECTIONS), default=None)
    a = ap.parse_args(argv)
    sizes = SIZES["smoke" if a.smoke else "full"]
    dev = jax.devices()[0]
    report = {
        "device": f"{len(jax.devices())} x {dev.device_kind} ({dev.platform})",
        "jax": jax.__version__, "smoke": a.smoke, "sections": {},
    }  # fmt: skip
    start = time.perf_counter()
    for name in a.only or SECTIONS:
        elapsed = time.perf_counter() - start
        if elapsed > a.budget:
            report["sections"][name] = {"skipped": f"budget spent ({elapsed:.0f} s)"}
            continue
        t0 = time.perf_counter()
        try:
            out = SECTIONS[name](sizes)
        except Exception as err:  # noqa: BLE001 - recorded, the rest runs
            out = {"error": f"{type(err).__name__}: {str(err)[:300]}",
                   "traceback": traceback.format_exc()[-2000:]}  # fmt: skip
        out["section_s"] = time.perf_counter() - t0
        report["sections"][name] = out
        print(f"{name}: {out['section_s']:.1f} s", file=sys.stderr, flush=True)
    report["total_s"] = time.perf_counter() - start
    table = markdown(report)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(os.path.splitext(a.out)[0] + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    return report


if __name__ == "__main__":
    main()
