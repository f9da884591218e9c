"""Throughput of a K-member vmapped sweep vs K sequential runs; memory per member.

Both sides train the same K = 8 CharLMs (different init and data keys) for the
same number of steps in this process, each after a warm-up that compiles it:

- sequential: `blocklab.train_lm` once per member (one compiled chunk, reused);
- sweep: `blocklab.train_sweep` over the 8 members (one compiled program).

The ratio of the two wall times is the speed-up. Memory per member comes from
XLA's compiled memory analysis of one chunk of fused steps (arguments +
outputs + temporaries, minus aliased donated buffers) at K = 1 and K = 8.

With `--processes 2`, instead: the throughput of one `train_sweep` run as 2
processes x 1 device (`blocklab launch --processes 2`) against 1 process x 2
devices (`XLA_FLAGS=--xla_force_host_platform_device_count=2`), the same
layout, members and steps; each side times a second, compiled run.

Run: `python benchmarks/sweep.py [--steps 50] [--members 8] [--json]`, or
`python benchmarks/sweep.py --processes 2 [--steps 50] [--members 8]`.
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
import subprocess  # noqa: E402
import time  # noqa: E402

from blocklab import RunConfig, SweepConfig  # noqa: E402
from blocklab.training import distributed  # noqa: E402

if "--child" in sys.argv:
    distributed.initialize()  # joins the launcher's job before any JAX work

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

from blocklab import CharLM, TimeMachine, train_lm, train_sweep  # noqa: E402
from blocklab.training.member_axis import (  # noqa: E402
    global_rows,
    key_data,
    member_sharding,
    pad_rows,
)
from blocklab.training.step import make_train_step  # noqa: E402
from blocklab.training.sweep import (  # noqa: E402
    _init_states,
    _run_chunk,
    member_mesh,
    pad_members,
    sweep_optimizer,
)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--members", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--num-hiddens", type=int, default=64)
    p.add_argument("--num-blks", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--processes",
        type=int,
        default=None,
        help="compare N processes x 1 device with 1 process x N devices",
    )
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args()


def child(a: argparse.Namespace) -> None:
    """One timed sweep (after a compiling one) on every device of the job."""
    data = TimeMachine(seq_len=a.seq_len, num_val=0)

    def make_model(key):
        return CharLM(
            data.vocab_size, a.num_hiddens, 4, a.num_blks, max_len=a.seq_len, key=key
        )

    def sweep():
        train_sweep(
            make_model,
            data,
            a.steps,
            model_keys=list(range(a.members)),
            data_keys=list(range(100, 100 + a.members)),
            run=RunConfig(
                batch_size=a.batch_size, steps_per_call=a.steps, progress=False
            ),
            sweep=SweepConfig(learning_rates=1e-3, validate=False),
        )

    sweep()
    best = float("inf")
    for _ in range(2):
        distributed.barrier("bench")
        t0 = time.perf_counter()
        sweep()
        best = min(best, time.perf_counter() - t0)
    if distributed.is_main_process():
        print(json.dumps({
            "processes": jax.process_count(), "devices": jax.device_count(),
            "seconds": best, "member_steps_per_s": a.members * a.steps / best,
        }))  # fmt: skip


def compare_processes(a: argparse.Namespace) -> None:
    n = a.processes
    opts = [
        "--child", "--members", str(a.members), "--steps", str(a.steps),
        "--num-hiddens", str(a.num_hiddens), "--num-blks", str(a.num_blks),
        "--batch-size", str(a.batch_size), "--seq-len", str(a.seq_len),
    ]  # fmt: skip
    me = [sys.executable, os.path.abspath(__file__), *opts]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    one_env = {**env, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}
    one = subprocess.run(me, env=one_env, capture_output=True, text=True, check=True)
    launch = [sys.executable, "-m", "blocklab.cli", "launch", "--processes", str(n)]
    many = subprocess.run(
        [*launch, "--", *me], env=env, capture_output=True, text=True, check=True
    )
    r1, rn = (json.loads(x.stdout.strip().splitlines()[-1]) for x in (one, many))
    out = {
        "config": {k: v for k, v in vars(a).items() if k != "child"},
        f"1 process x {n} devices": r1,
        f"{n} processes x 1 device": rn,
        "throughput_ratio": rn["member_steps_per_s"] / r1["member_steps_per_s"],
    }
    if a.json:
        print(json.dumps(out))
        return
    print(f"CharLM d={a.num_hiddens}, K={a.members}, {a.steps} steps\n")
    print("| layout | wall (s) | member-steps/s |")
    print("|---|---:|---:|")
    for name in (f"1 process x {n} devices", f"{n} processes x 1 device"):
        r = out[name]
        print(f"| {name} | {r['seconds']:.2f} | {r['member_steps_per_s']:.1f} |")
    print(f"\n{n} processes / 1 process: {out['throughput_ratio']:.2f}x")


def chunk_memory(make_model, data, K, steps, batch_size) -> dict[str, int]:
    """Compiled memory of one chunk of `steps` fused steps for K members (bytes)."""
    mesh = member_mesh()
    sharding = member_sharding(mesh)
    size = pad_members(K, mesh.devices.size)
    opt = sweep_optimizer(optax.adamw, weight_decay=0.0)
    keys = global_rows(pad_rows(key_data(list(range(K))), size), mesh)
    lrs = global_rows(pad_rows(np.full(K, 1e-3, np.float32), size), mesh)
    states = _init_states(make_model, opt, sharding, keys, {"learning_rate": lrs})
    step = make_train_step(opt, data, batch_size=batch_size)
    fixed = (step, keys, jnp.asarray(0, jnp.int32))
    compiled = _run_chunk.lower(fixed, states, steps, sharding).compile()
    m = compiled.compiled.memory_analysis()
    total = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        + m.temp_size_in_bytes
        - m.alias_size_in_bytes
    )
    return {
        "total": int(total),
        "temp": int(m.temp_size_in_bytes),
        "arguments": int(m.argument_size_in_bytes),
    }


def main() -> None:
    a = parse()
    if a.child:
        child(a)
        return
    if a.processes is not None:
        compare_processes(a)
        return
    # No validation windows: both sides time training only.
    data = TimeMachine(seq_len=a.seq_len, num_val=0)
    K = a.members

    def make_model(key):
        return CharLM(
            data.vocab_size, a.num_hiddens, 4, a.num_blks, max_len=a.seq_len, key=key
        )

    # One optimizer object: train_lm's compiled chunk is reused across runs.
    optimizer = optax.adamw(1e-3, weight_decay=0.0)

    def sequential():
        for k in range(K):
            train_lm(
                make_model(jax.random.key(k)),
                data,
                optimizer,
                a.steps,
                key=jax.random.key(100 + k),
                batch_size=a.batch_size,
                steps_per_call=a.steps,
                progress=False,
            )

    def sweep():
        train_sweep(
            make_model,
            data,
            a.steps,
            model_keys=list(range(K)),
            data_keys=list(range(100, 100 + K)),
            run=RunConfig(
                batch_size=a.batch_size, steps_per_call=a.steps, progress=False
            ),
            sweep=SweepConfig(learning_rates=1e-3, validate=False),
        )

    times = {}
    for name, fn in (("sequential", sequential), ("sweep", sweep)):
        fn()  # compile
        best = float("inf")
        for _ in range(2):  # best of two: the machine is shared
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        times[name] = best
    mem1 = chunk_memory(make_model, data, 1, a.steps, a.batch_size)
    memK = chunk_memory(make_model, data, K, a.steps, a.batch_size)
    out = {
        "devices": f"{len(jax.devices())} x {jax.devices()[0].device_kind}",
        "config": vars(a),
        "sequential_s": times["sequential"],
        "sweep_s": times["sweep"],
        "member_steps_per_s": {n: K * a.steps / t for n, t in times.items()},
        "speedup": times["sequential"] / times["sweep"],
        "memory_per_member_MiB": {
            "K=1": mem1["total"] / 2**20,
            f"K={K}": memK["total"] / K / 2**20,
        },
    }
    if a.json:
        print(json.dumps(out))
        return
    print(
        f"{out['devices']}; CharLM d={a.num_hiddens}, {a.num_blks} blocks, batch "
        f"{a.batch_size} x {a.seq_len}, {a.steps} steps, K={K}\n"
    )
    print("| run | wall (s) | member-steps/s | memory per member (MiB) |")
    print("|---|---:|---:|---:|")
    print(
        f"| {K} sequential train_lm | {times['sequential']:.2f} | "
        f"{out['member_steps_per_s']['sequential']:.1f} | "
        f"{out['memory_per_member_MiB']['K=1']:.1f} |"
    )
    print(
        f"| train_sweep, K={K} | {times['sweep']:.2f} | "
        f"{out['member_steps_per_s']['sweep']:.1f} | "
        f"{out['memory_per_member_MiB'][f'K={K}']:.1f} |"
    )
    print(f"\nspeed-up of the sweep: {out['speedup']:.2f}x")


if __name__ == "__main__":
    main()
