"""Training one model on a mesh of simulated devices equals training on one.

The models are converted from `transformers` by
`blocklab.interop.from_huggingface`: a `LlamaForCausalLM` and a
`MixtralForCausalLM` with random weights from a small config (nothing
downloads). Each run is a fresh process (the device count is fixed when JAX
starts): `XLA_FLAGS=--xla_force_host_platform_device_count=8`. Within one
process, `train_model` without a mesh runs on device 0 alone: that is the
reference. Losses agree to float rounding (a split batch or contraction
sums in another order), so the comparisons are relative 1e-5, not
bit-exact; the tests print which layouts happened to be bit-exact."""

import json
import re
import sys
import textwrap

import numpy as np
import pytest
from _procs import blocklab, devices_env, run, script_json

pytest.importorskip("torch", reason="the models are converted from transformers")
pytest.importorskip("transformers", reason="the models are converted from transformers")

SCRIPT = textwrap.dedent(
    """
    import functools, json, sys
    import jax, numpy as np, optax
    from blocklab.data import TimeMachine
    from blocklab.training.placement import mesh_of
    from blocklab.training.run import train_model
    from blocklab import RunConfig, SweepConfig

    jobs = json.loads(sys.argv[1])
    if jobs and jobs[0][0] == "launch":
        from blocklab.training import distributed
        distributed.initialize()
        jobs = jobs[1:]
    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
    out = {}

    @functools.cache
    def model(kind):
        # Converted from transformers (random weights from a small config,
        # nothing downloads): Llama (GQA 4:2, SwiGLU, RoPE, untied head) and
        # Mixtral (4 experts, top-2). Sizes divide every mesh below: width 32
        # over data=8, 4 heads / 2 KV heads of 8 features and FFN 64 over
        # model<=4, 4 experts over expert=4.
        import torch, transformers
        from blocklab.interop import from_huggingface
        torch.manual_seed(0)
        common = dict(vocab_size=32, hidden_size=32, num_attention_heads=4,
                      num_key_value_heads=2, num_hidden_layers=2,
                      max_position_embeddings=16, bos_token_id=0, eos_token_id=0,
                      pad_token_id=0, attn_implementation="eager")
        if kind == "moe":
            hf = transformers.MixtralForCausalLM(transformers.MixtralConfig(
                intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                **common))
        else:
            hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
                intermediate_size=64, **common))
        m = from_huggingface(hf.eval())
        # the converted model is the transformers model (logits at init)
        ids = np.arange(32).reshape(2, 16) % 28
        with torch.no_grad():
            want = hf(torch.as_tensor(ids)).logits.numpy()
        got = np.asarray(jax.vmap(m)(ids)) if kind == "moe" else np.asarray(m(ids))
        out[f"{kind}/converted_err"] = float(np.abs(got - want).max()
                                             / np.abs(want).max())
        return m

    def nbytes(tree, device):
        # bytes of the trained leaves held by one device
        total = 0
        for a in jax.tree_util.tree_leaves(tree):
            if hasattr(a, "addressable_shards") and a.ndim:
                total += sum(s.data.nbytes for s in a.addressable_shards
                             if s.device == device)
        return total

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
                        key=jax.random.key(1),
                        run=RunConfig(batch_size=8, steps_per_call=10,
                                      progress=False, mesh=mesh, rules=rules,
                                      precision=precision))
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
    return script_json(SCRIPT, json.dumps(jobs), devices=devices, timeout=timeout)


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
    print("bit-exact fsdp:", _close(fsdp["losses"], one["losses"]))
    _close(fsdp["val"], one["val"])
    assert len(fsdp["losses"]) == 20 and fsdp["losses"][-1] < fsdp["losses"][0] - 0.5
    # parameters + Adam's m and v: one device holds about 1/8 of them
    assert one["per_device"] == one["total"]
    assert fsdp["per_device"] <= 1.1 * fsdp["total"] / 8, fsdp
    assert res["llama/converted_err"] < 1e-4  # the transformers model's logits
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
        print("bit-exact", key, _close(res[key]["losses"], one["losses"]))
    # bf16 rounds the products: equal to the bf16 run on one device, to bf16's
    # precision, and near the float32 run
    bf16 = res["llama/none/None/bf16"]["losses"]
    _close(res["llama/data=8/fsdp/bf16"]["losses"], bf16, rtol=2e-2)
    _close(res["llama/none/None/bf16"]["losses"], one["losses"], rtol=5e-2)
    assert res["moe/converted_err"] < 1e-4
    moe = res["moe/none/None/float32"]
    for key in [
        "moe/data=2,expert=4/ep/float32",
        "moe/data=2,expert=4/fsdp+ep/float32",
    ]:
        print("bit-exact", key, _close(res[key]["losses"], moe["losses"]))
        assert res[key]["per_device"] < moe["per_device"]


SWEEP = textwrap.dedent(
    """
    import json, sys
    import jax, numpy as np
    from blocklab.data import TimeMachine
    from blocklab.models.decoder import DecoderLM
    from blocklab.training.placement import mesh_of
    from blocklab.training.sweep import train_sweep

    spec = sys.argv[1]
    import transformers  # the config converted from transformers' (no torch weights)
    from blocklab.interop import hf_config_to_decoder
    cfg = hf_config_to_decoder(transformers.LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_attention_heads=4,
        num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=16),
        "LlamaForCausalLM")
    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
    r = train_sweep(lambda k: DecoderLM(cfg, key=k), data, 10, model_keys=[0, 1],
                    data_keys=[5, 6],
                    run=RunConfig(batch_size=8, steps_per_call=5, progress=False,
                                  mesh=None if spec == "none" else mesh_of(spec)),
                    sweep=SweepConfig(learning_rates=[1e-3, 3e-3]))
    w = r.state.model.stack.blocks.attention.W_q.weight
    print(json.dumps({"losses": r.losses.tolist(), "val": r.val_loss.tolist(),
                      "shard": list(w.addressable_shards[0].data.shape)}))
    """
)


@pytest.mark.slow
def test_a_sweep_of_2_members_by_4_fsdp_shards_equals_the_unsharded_sweep():
    one = script_json(SWEEP, "none", devices=1)
    mesh = script_json(SWEEP, "members=2,data=4", devices=8)
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


IDS = textwrap.dedent(
    r"""
    import json, re
    import equinox as eqx, jax, numpy as np, optax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from blocklab.data import TimeMachine
    from blocklab.models import DecoderConfig, DecoderLM
    from blocklab.training import mesh_training as meshes
    from blocklab.training.placement import mesh_of
    from blocklab.training.sweep import train_sweep
    from blocklab.training.losses import lm_loss
    from blocklab.training.run import train_model
    from blocklab import RunConfig, SweepConfig
    from blocklab.training.step import make_train_step, step_keys

    def facts(txt):
        # the error callbacks' operand and result shapes, the conditionals'
        # results, and every collective over a non-scalar integer array (with
        # its op_name, when XLA kept one)
        calls = [l for l in txt.splitlines()
                 if "custom-call(" in l and "python_cpu_callback" in l]
        return {
            "callback_operands": [
                re.search(r"operand_layout_constraints=\{([^}]*)\}", l).group(1)
                for l in calls],
            "callback_results": [re.search(r"= (\([^)]*\)|\S+) custom-call", l)
                                 .group(1) for l in calls],
            "conditionals": re.findall(r"= (\([^)]*\)|\S+) conditional\(", txt),
            "int_collectives": re.findall(
                r"= \(?([su]32\[[\d,]+\][^=\n]*) (?:all-gather|all-reduce|all-to-all"
                r"|collective-permute)(?:-start)?\((?:[^\n]*?op_name=\"([^\"]*)\")?",
                txt),
        }

    def refused(fn):
        try:
            jax.block_until_ready(fn())
            return None
        except Exception as err:  # noqa: BLE001 - EquinoxRuntimeError
            return re.findall(r"EquinoxRuntimeError: (.*)", str(err))

    out = {}
    mesh = mesh_of("data=8")
    B, T, V = 16, 8, 40
    rows = NamedSharding(mesh, P("data"))
    logits = jax.device_put(jax.random.normal(jax.random.key(0), (B, T, V)), rows)
    Y = np.arange(B * T, dtype=np.int32).reshape(B, T) % V
    loss = eqx.filter_jit(lambda z, y: lm_loss(lambda x: z, y, y))
    with jax.set_mesh(mesh):
        y = jax.device_put(Y, rows)
        out["loss_hlo"] = facts(loss.lower(logits, y).lowered.compile().as_text())
        out["loss"] = float(loss(logits, y))
        # row 5 lives on device 2, row 13 on device 6
        for name, (b, t, v) in {"high": (5, 3, V + 7), "low": (13, 0, -3)}.items():
            bad = Y.copy()
            bad[b, t] = v
            out[name] = refused(lambda: loss(logits, jax.device_put(bad, rows)))
    out["loss_1dev"] = float(lm_loss(lambda x: np.asarray(logits), Y, Y))

    # The fused train step (fsdp): DecoderLM's token-id check and lm_loss's.
    def llama(vocab):
        cfg = DecoderConfig.llama(vocab_size=vocab, num_hiddens=32, num_heads=4,
                                  num_blks=1, num_kv_heads=2, ffn_width=64, max_len=16)
        return DecoderLM(cfg, key=jax.random.key(0))

    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)  # ids 0..27
    opt = optax.adamw(1e-3)
    step = meshes.shard_step(make_train_step(opt, data, batch_size=8), mesh, "fsdp")
    state, sh = meshes.sharded_state(llama(32), opt, mesh, "fsdp")
    with jax.set_mesh(mesh):
        keys = step_keys(jax.random.key(1), 0, 2)
        low = meshes._run_chunk.lower((step, sh), state, keys)
    out["step_hlo"] = facts(low.lowered.compile().as_text())
    # a vocabulary smaller than the data's: refused in train_model and train_sweep
    out["train"] = refused(lambda: train_model(
        llama(16), data, opt, 2, key=jax.random.key(1),
        run=RunConfig(batch_size=8, progress=False, mesh=mesh)).losses)
    out["sweep"] = refused(lambda: train_sweep(
        lambda k: llama(16), data, 2, model_keys=[0, 1], data_keys=[5, 6],
        run=RunConfig(batch_size=8, steps_per_call=2, progress=False,
                      mesh=mesh_of("members=2,data=4")),
        sweep=SweepConfig(learning_rates=[1e-3, 3e-3])).losses)
    print(json.dumps(out))
    """
)


@pytest.mark.slow  # 8 devices in a child, ~20 s; the traced check below stays default
def test_ids_out_of_range_are_refused_on_a_mesh_without_gathering_the_batch():
    """`check_ids` on a mesh (8 simulated devices, the batch split over `data`).

    (a) An id out of range, held by a device other than 0, is refused with a
    message naming it and the vocabulary size, by `lm_loss` under
    `eqx.filter_jit`, by `train_model(mesh=)` and by `train_sweep` on a
    members x data mesh (before, device 0's error callback raised while the
    other devices waited in the broadcast of its result: a stall, then the
    runtime aborted the process).
    (b) The compiled programs hand the error branch only scalars: every
    callback takes and returns `s32[]`, every conditional returns a scalar,
    and no collective moves the `(B, T)` ids for the check (the old
    `eqx.error_if(ids, ...)` pinned the whole batch to device 0 in a
    conditional, replicated it by an all-reduce and re-split it, with XLA's
    "involuntary full rematerialization" warning).
    """
    rc, out, err = run([sys.executable, "-c", IDS], env=devices_env(8), timeout=600)
    assert rc == 0, err[-4000:]
    res = json.loads(out.strip().splitlines()[-1])
    assert "Involuntary full rematerialization" not in err
    np.testing.assert_allclose(res["loss"], res["loss_1dev"], rtol=1e-6)
    got = "(the {} id of the batch; check the ids' encoding)."
    want = "lm_loss: target ids must lie in [0, vocab=40), got "
    assert res["high"] == [want + "47 " + got.format("largest")]
    assert res["low"] == [want + "-3 " + got.format("smallest")]
    # TimeMachine's ids run to 27: every batch of 8 x 16 characters has some
    # id >= 16 (the message names the batch's largest)
    for key in ("train", "sweep"):
        (msg,) = res[key]
        m = re.fullmatch(
            r"DecoderLM: token ids must lie in \[0, vocab_size=16\), got (\d+) "
            + re.escape(got.format("largest")),
            msg,
        )
        assert m and 16 <= int(m.group(1)) <= 27, msg
    for name, n_checks in (("loss_hlo", 1), ("step_hlo", 2)):
        hlo = res[name]
        # equinox's two callbacks (raise; TPU message) per check, all on scalars
        assert len(hlo["callback_operands"]) == 2 * n_checks, hlo
        assert all(re.fullmatch(r"s32\[\](, s32\[\])*", o) for o in
                   hlo["callback_operands"]), hlo  # fmt: skip
        assert set(hlo["callback_results"]) == {"(s32[])"}, hlo
        assert hlo["conditionals"] and set(hlo["conditionals"]) == {"(s32[])"}, hlo
    assert res["loss_hlo"]["int_collectives"] == []
    # the step's one integer collective is the embedding lookup's (GSPMD's
    # choice for a table split on `embed`: gather the ids, not the table)
    for shape, op in res["step_hlo"]["int_collectives"]:
        assert op.endswith("/gather") and "error_if" not in op, (shape, op)


def test_traced_id_check_names_the_id_across_vmapped_members():
    """Under `vmap` (a sweep's members) the error names the largest id over
    all members if one is too large, else the smallest (negative) one."""
    import equinox as eqx
    import jax

    from blocklab._validate import check_ids

    f = eqx.filter_jit(jax.vmap(lambda y: check_ids("f", "ids", y, 10)))
    ok = np.arange(12).reshape(2, 6) % 10
    np.testing.assert_array_equal(f(ok), ok)
    for (m, t, v), want in [
        ((1, 4, 99), 99),
        ((0, 0, -5), -5),
        ((1, 5, 10), 10),
        ((0, 3, -(2**31)), -(2**31)),
    ]:
        bad = ok.copy()
        bad[m, t] = v
        if v == -5:
            bad[1, 2] = -1  # the smallest of two negatives, in another member
        with pytest.raises(eqx.EquinoxRuntimeError, match=rf"got {want} \(the"):
            f(bad)


def test_a_mesh_given_as_text_is_refused_by_name(plain_python):
    """`train_model(..., mesh="data=8")` failed with an AttributeError."""
    import jax
    import optax

    import blocklab as bl
    from blocklab import ConfigError

    model = bl.CharLM(28, 16, 2, 1, key=jax.random.key(0))
    with pytest.raises(
        ConfigError,
        match=r"RunConfig: mesh must be a jax.sharding.Mesh or None, got 'data=8'",
    ):
        bl.train_model(
            model,
            bl.TimeMachine(),
            optax.adam(1e-3),
            2,
            key=jax.random.key(0),
            run=bl.RunConfig(mesh="data=8"),
        )
