"""Training one model on a mesh of simulated devices equals training on one.

Each run is a fresh process (the device count is fixed when JAX starts):
`XLA_FLAGS=--xla_force_host_platform_device_count=8`. Within one process,
`train_model` without a mesh runs on device 0 alone: that is the reference.
Losses agree to float rounding (a split batch or contraction sums in
another order), so the comparisons are relative 1e-5, not bit-exact; the
script reports which layouts happened to be bit-exact.
"""

import json
import sys
import textwrap

import numpy as np
import pytest
from _procs import blocklab, run

SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np, optax
    from blocklab.data import TimeMachine
    from blocklab.nn.decoder import DecoderConfig, DecoderLM
    from blocklab.training.partition import mesh_of
    from blocklab.training.train import train_model

    jobs = json.loads(sys.argv[1])
    if jobs and jobs[0][0] == "launch":
        from blocklab.training import distributed
        distributed.initialize()
        jobs = jobs[1:]
    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)

    def model(kind):
        if kind == "moe":
            from blocklab.interop.mixtral import MoEDecoderConfig
            cfg = MoEDecoderConfig(32, 32, 4, 2, num_kv_heads=2, num_experts=4,
                                   top_k=2, ffn_width=32, max_len=16)
        else:  # a Llama-like config (GQA 4:2, SwiGLU, RoPE, untied head)
            cfg = DecoderConfig.llama(vocab_size=32, num_hiddens=32, num_heads=4,
                                      num_blks=2, num_kv_heads=2, ffn_width=64,
                                      max_len=16)
        return DecoderLM(cfg, key=jax.random.key(0))

    def nbytes(tree, device):
        # bytes of the trained leaves held by one device
        total = 0
        for a in jax.tree_util.tree_leaves(tree):
            if hasattr(a, "addressable_shards") and a.ndim:
                total += sum(s.data.nbytes for s in a.addressable_shards
                             if s.device == device)
        return total

    out = {}
    from jax.sharding import Mesh
    from blocklab import ConfigError, shard
    try:  # a mesh over half the devices
        shard(model("llama"), Mesh(np.asarray(jax.devices()[:4]), ("data",)), "fsdp")
        out["refused"] = None
    except ConfigError as err:
        out["refused"] = str(err)
    for kind, spec, rules, precision in jobs:
        mesh = None if spec == "none" else mesh_of(spec)
        r = train_model(model(kind), data, optax.adamw(3e-3), 20,
                        key=jax.random.key(1), batch_size=8, steps_per_call=10,
                        progress=False, mesh=mesh, rules=rules, precision=precision)
        trained = (r.state.model, r.state.opt_state)
        dev = jax.local_devices()[0]
        full = sum(a.nbytes for a in jax.tree_util.tree_leaves(trained)
                   if hasattr(a, "nbytes") and a.ndim)
        out[f"{kind}/{spec}/{rules}/{precision}"] = {
            "losses": r.losses.tolist(), "val": r.val_loss,
            "per_device": nbytes(trained, dev), "total": full,
            "devices": jax.device_count(),
        }
    print(json.dumps(out))
    """
)


def _run(jobs, devices=8, timeout=900):
    env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
    rc, out, err = run([sys.executable, "-c", SCRIPT, json.dumps(jobs)], env=env,
                       timeout=timeout)  # fmt: skip
    assert rc == 0, err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def _close(a, b, rtol=1e-5):
    a, b = np.asarray(a), np.asarray(b)
    np.testing.assert_allclose(a, b, rtol=rtol, atol=0)
    return bool(np.array_equal(a, b))


def test_fsdp_on_8_devices_equals_one_device_at_an_eighth_of_the_bytes():
    res = _run(
        [["llama", "none", None, "float32"], ["llama", "data=8", "fsdp", "float32"]]
    )
    one = res["llama/none/None/float32"]
    fsdp = res["llama/data=8/fsdp/float32"]
    assert fsdp["devices"] == 8
    _close(fsdp["losses"], one["losses"])
    _close(fsdp["val"], one["val"])
    assert len(fsdp["losses"]) == 20 and fsdp["losses"][-1] < fsdp["losses"][0] - 0.5
    # parameters + Adam's m and v: one device holds about 1/8 of them
    assert one["per_device"] == one["total"]
    assert fsdp["per_device"] <= 1.1 * fsdp["total"] / 8, fsdp
    assert "{'data': 4} has 4 devices" in res["refused"]
    assert "jax.device_count() is 8" in res["refused"]


@pytest.mark.slow
def test_tp_fsdp_tp_ep_and_bf16_equal_one_device():
    jobs = [
        ["llama", "none", None, "float32"],
        ["llama", "data=2,model=4", "tp", "float32"],
        ["llama", "data=4,model=2", "fsdp+tp", "float32"],
        ["llama", "none", None, "bf16"],
        ["llama", "data=8", "fsdp", "bf16"],
        ["moe", "none", None, "float32"],
        ["moe", "data=2,expert=4", "ep", "float32"],
        ["moe", "data=2,expert=4", "fsdp+ep", "float32"],
    ]
    res = _run(jobs)
    one = res["llama/none/None/float32"]
    for key in [
        "llama/data=2,model=4/tp/float32",
        "llama/data=4,model=2/fsdp+tp/float32",
    ]:
        _close(res[key]["losses"], one["losses"])
    # bf16 rounds the products: equal to the bf16 run on one device, to bf16's
    # precision, and near the float32 run
    bf16 = res["llama/none/None/bf16"]["losses"]
    _close(res["llama/data=8/fsdp/bf16"]["losses"], bf16, rtol=2e-2)
    _close(res["llama/none/None/bf16"]["losses"], one["losses"], rtol=5e-2)
    moe = res["moe/none/None/float32"]
    for key in [
        "moe/data=2,expert=4/ep/float32",
        "moe/data=2,expert=4/fsdp+ep/float32",
    ]:
        _close(res[key]["losses"], moe["losses"])
        assert res[key]["per_device"] < moe["per_device"]


SWEEP = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from blocklab.data import TimeMachine
    from blocklab.nn.decoder import DecoderConfig, DecoderLM
    from blocklab.training.partition import mesh_of
    from blocklab.training.sweep import train_sweep

    spec = sys.argv[1]
    cfg = DecoderConfig.llama(vocab_size=32, num_hiddens=32, num_heads=4, num_blks=2,
                              num_kv_heads=2, ffn_width=64, max_len=16)
    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
    r = train_sweep(lambda k: DecoderLM(cfg, key=k), data, 10, model_keys=[0, 1],
                    data_keys=[5, 6], learning_rates=[1e-3, 3e-3], batch_size=8,
                    steps_per_call=5, progress=False,
                    mesh=None if spec == "none" else mesh_of(spec))
    w = r.state.model.stack.blocks.attention.W_q.weight
    print(json.dumps({"losses": r.losses.tolist(), "val": r.val_loss.tolist(),
                      "shard": list(w.addressable_shards[0].data.shape)}))
    """
)


@pytest.mark.slow
def test_a_sweep_of_2_members_by_4_fsdp_shards_equals_the_unsharded_sweep():
    def go(spec, devices):
        env = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}"}
        rc, out, err = run([sys.executable, "-c", SWEEP, spec], env=env, timeout=900)
        assert rc == 0, err[-4000:]
        return json.loads(out.strip().splitlines()[-1])

    one, mesh = go("none", 1), go("members=2,data=4", 8)
    _close(mesh["losses"], one["losses"])
    _close(mesh["val"], one["val"])
    # each device: one member, a quarter of its embed axis (32 / 4)
    assert mesh["shard"] == [1, 2, 32, 8] and one["shard"] == [2, 2, 32, 32]


@pytest.mark.slow
def test_two_processes_of_four_devices_equal_one_process_of_eight():
    jobs = [["llama", "data=8", "fsdp", "float32"]]
    single = _run(jobs)
    rc, out, err = blocklab(
        "launch", "--processes", "2", "--devices-per-process", "4", "--",
        sys.executable, "-c", SCRIPT, json.dumps([["launch"], *jobs]), timeout=600,
    )  # fmt: skip
    assert rc == 0, err[-4000:]
    multi = json.loads(out.strip().splitlines()[-1])
    key = "llama/data=8/fsdp/float32"
    assert multi[key]["devices"] == 8
    _close(multi[key]["losses"], single[key]["losses"])
    assert multi[key]["per_device"] == single[key]["per_device"]
