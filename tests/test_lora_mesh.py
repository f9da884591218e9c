"""LoRA training under fsdp and tp on 8 simulated devices equals one device
(issue 33 item 6), on `Auto` meshes and on `Explicit` ones as
`jax.make_mesh` makes them; the adapters' arrays are laid out as the weight
they adapt (A's input axis as the weight's, B's output axis as the weight's,
the rank replicated), asserted on the trained arrays' shardings.

One fresh process with 8 CPU devices (the device count is fixed when JAX
starts); the reference is `train_model` without a mesh in that process
(device 0 alone). Losses and adapters agree to float32 rounding (a split
contraction sums in another order).
"""

import textwrap

import numpy as np
import pytest
from _procs import script_json

pytestmark = pytest.mark.slow  # a fresh 8-device process compiling 5 runs

SCRIPT = textwrap.dedent(
    """
    import json
    import jax, numpy as np, optax
    from jax.sharding import AxisType
    from blocklab.data import TimeMachine
    from blocklab.models import DecoderConfig, DecoderLM
    from blocklab.nn.lora import lora, lora_optimizer, unmerge_lora
    from blocklab.training.placement import mesh_of
    from blocklab.training.run import train_model
    from blocklab import LoRAConfig, RunConfig

    # width 32 over data=8; 4 heads / 2 KV heads and FFN 64 over model=4
    base = DecoderLM(DecoderConfig.llama(
        vocab_size=32, num_hiddens=32, num_heads=4, num_blks=2, num_kv_heads=2,
        ffn_width=64, max_len=16), key=jax.random.key(0))
    model = lora(base, LoRAConfig(rank=4, alpha=8.0,
                 targets=["q", "k", "v", "o", "gate", "up", "down"]),
                 key=jax.random.key(1))
    data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
    E = AxisType.Explicit
    runs = {
        "none": (None, None),
        "fsdp/auto": (mesh_of("data=8"), "fsdp"),
        "fsdp/explicit": (jax.make_mesh((8,), ("data",), axis_types=(E,)), "fsdp"),
        "tp/auto": (mesh_of("data=2,model=4"), "tp"),
        "tp/explicit": (jax.make_mesh((2, 4), ("data", "model"),
                                      axis_types=(E, E)), "tp"),
    }
    out = {"devices": jax.device_count()}
    for name, (mesh, rules) in runs.items():
        r = train_model(model, data, lora_optimizer(optax.adam(1e-2)), 6,
                        key=jax.random.key(2),
                        run=RunConfig(batch_size=8, steps_per_call=3,
                                      progress=False, mesh=mesh, rules=rules))
        blocks = r.state.model.stack.blocks
        res = {"losses": r.losses.tolist(), "val": r.val_loss, "specs": {},
               "adapters": {}}
        for proj, lin in (("q", blocks.attention.W_q), ("down", blocks.ffn.W_2)):
            res["adapters"][proj] = [np.asarray(lin.A).tolist(),
                                     np.asarray(lin.B).tolist()]
            res["specs"][proj] = [
                [None if p is None else str(p) for p in tuple(a.sharding.spec)]
                + [None] * (a.ndim - len(a.sharding.spec))
                for a in (lin.base.weight, lin.A, lin.B)
            ] if mesh is not None else None
        trained_base, _ = unmerge_lora(r.model)
        res["base_kept"] = all(
            bool(np.array_equal(a, b)) for a, b in zip(
                jax.tree.leaves(trained_base), jax.tree.leaves(base)))
        out[name] = res
    print(json.dumps(out))
    """
)


@pytest.fixture(scope="module")
def runs():
    return script_json(SCRIPT, devices=8, timeout=900)


@pytest.mark.parametrize(
    "name", ["fsdp/auto", "fsdp/explicit", "tp/auto", "tp/explicit"]
)
def test_lora_training_on_8_devices_equals_one_device(runs, name):
    one, got = runs["none"], runs[name]
    assert runs["devices"] == 8
    np.testing.assert_allclose(got["losses"], one["losses"], rtol=1e-5)
    np.testing.assert_allclose(got["val"], one["val"], rtol=1e-5)
    for proj in ("q", "down"):
        for a, b in zip(got["adapters"][proj], one["adapters"][proj], strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    # the adapters trained (B moved off zero) and the base did not
    assert np.abs(np.asarray(one["adapters"]["down"][1])).max() > 1e-3
    assert got["base_kept"] and one["base_kept"]
    assert one["losses"][-1] < one["losses"][0]


@pytest.mark.parametrize(
    "name", ["fsdp/auto", "fsdp/explicit", "tp/auto", "tp/explicit"]
)
def test_adapters_are_sharded_as_the_weight_they_adapt(runs, name):
    for proj in ("q", "down"):
        weight, A, B = runs[name]["specs"][proj]
        layer, out, inp = weight
        assert A == [layer, None, inp], (proj, weight, A)
        assert B == [layer, out, None], (proj, weight, B)
    # the layouts are not trivial: fsdp splits the weights over data, tp the
    # heads (q's output) and the FFN width (down's input) over model
    q_w = runs[name]["specs"]["q"][0]
    down_w = runs[name]["specs"]["down"][0]
    if name.startswith("fsdp"):
        assert "data" in q_w and "data" in down_w
    else:
        assert q_w[1] == "model" and down_w[2] == "model"
