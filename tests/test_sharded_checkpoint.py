"""Sharded checkpoints (orbax): round trip, exact resume, moving between meshes,
and the refusals (another config, a folder that is no checkpoint)."""

import textwrap

import equinox as eqx
import jax
import numpy as np
import optax
import pytest
from _procs import script_json
from jax.sharding import Mesh

from blocklab import ConfigError, DecoderConfig, DecoderLM, RunConfig, TimeMachine
from blocklab.training.checkpoint import CheckpointError
from blocklab.training.run import train_model
from blocklab.training.sharded_checkpoint import (
    restore_sharded,
    save_sharded,
    sharded_metadata,
)
from blocklab.training.step import init_state

CFG = DecoderConfig.llama(vocab_size=32, num_hiddens=32, num_heads=4, num_blks=2,
                          num_kv_heads=2, ffn_width=64, max_len=16)  # fmt: skip


#: One optimizer object: the runs below share one compiled chunk.
OPT = optax.adam(3e-3)


def _train(model, n, state=None, mesh=None):
    data = TimeMachine(seq_len=16, num_train=1000, num_val=0)
    run = RunConfig(batch_size=4, steps_per_call=5, progress=False, mesh=mesh)
    return train_model(model, data, OPT, n, key=jax.random.key(1), state=state, run=run)


def test_save_restore_and_resume_continue_exactly(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    model = DecoderLM(CFG, key=jax.random.key(0))
    full = _train(model, 10, mesh=mesh)
    half = _train(model, 5, mesh=mesh)
    saved = save_sharded(tmp_path / "ck", half.state, data_position={"epoch": 0})
    meta = sharded_metadata(saved.path)
    assert meta["step"] == 5 and meta["data_position"] == {"epoch": 0}
    assert meta["config"] == DecoderLM(CFG, key=jax.random.key(0)).init_args()
    shape = eqx.filter_eval_shape(lambda k: DecoderLM(CFG, key=k), jax.random.key(0))
    back = restore_sharded(saved.path, shape, OPT, mesh=mesh)
    for a, b in zip(jax.tree_util.tree_leaves(half.state),
                    jax.tree_util.tree_leaves(back), strict=True):  # fmt: skip
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    resumed = _train(None, 5, state=back, mesh=mesh)
    # the same compiled chunks on the same device: bit for bit
    np.testing.assert_array_equal(resumed.losses, full.losses[5:])
    with pytest.raises(ConfigError, match="already exists"):
        save_sharded(saved.path, half.state)


def test_restoring_onto_another_config_is_refused(tmp_path):
    mesh = Mesh(np.asarray(jax.devices()[:1]), ("data",))
    model = DecoderLM(CFG, key=jax.random.key(0))
    state = init_state(model, OPT)  # nothing compiled: the refusals come first
    path = save_sharded(tmp_path / "ck", state).path
    deeper = dict(CFG.to_dict(), num_blks=3)
    other = DecoderLM(DecoderConfig(**deeper), key=jax.random.key(0))
    with pytest.raises(ConfigError, match=r"cfg\.num_blks \(saved 2, target 3\).*mesh"):
        restore_sharded(path, other, OPT, mesh=mesh)
    with pytest.raises(ConfigError, match=r"leaf .*mu.*does not hold|lacks"):
        restore_sharded(path, model, optax.sgd(1e-3), mesh=mesh)
    with pytest.raises(CheckpointError, match="not a sharded checkpoint"):
        sharded_metadata(tmp_path)


# Saves on one mesh, restores onto another in a process with another device
# count; the state and the continued run are compared with the unbroken run.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import equinox as eqx, jax, numpy as np, optax
    from blocklab import DecoderConfig, DecoderLM, TimeMachine
    from blocklab.training.placement import mesh_of
    from blocklab.training.sharded_checkpoint import restore_sharded, save_sharded
    from blocklab.training.run import train_model
    from blocklab import RunConfig

    what, path, spec, rules = sys.argv[1:5]
    cfg = DecoderConfig.llama(vocab_size=32, num_hiddens=32, num_heads=4, num_blks=2,
                              num_kv_heads=4, ffn_width=64, max_len=16)
    data = TimeMachine(seq_len=16, num_train=1000, num_val=0)
    mesh = mesh_of(spec)
    def train(n, **kw):
        return train_model(kw.pop("model", None), data, optax.adam(3e-3), n,
                           key=jax.random.key(1), **kw,
                           run=RunConfig(batch_size=8, steps_per_call=5,
                                         progress=False, mesh=mesh, rules=rules))
    if what == "save":
        model = DecoderLM(cfg, key=jax.random.key(0))
        full = train(10, model=model)
        half = train(5, model=model)
        save_sharded(path, half.state)
        w = half.state.opt_state[0].mu.stack.blocks.attention.W_q.weight
        out = {"losses": full.losses.tolist(), "spec": str(w.sharding.spec),
               "sum": [float(np.sum(np.asarray(a, np.float64)))
                       for a in jax.tree_util.tree_leaves(half.state)]}
    else:
        key = jax.random.key(0)
        shape = eqx.filter_eval_shape(lambda k: DecoderLM(cfg, key=k), key)
        state = restore_sharded(path, shape, optax.adam(3e-3), mesh=mesh, rules=rules)
        w = state.opt_state[0].mu.stack.blocks.attention.W_q.weight
        sums = [float(np.sum(np.asarray(a, np.float64)))
                for a in jax.tree_util.tree_leaves(state)]
        resumed = train(5, state=state)
        out = {"losses": resumed.losses.tolist(), "spec": str(w.sharding.spec),
               "sum": sums, "devices": len(w.sharding.device_set)}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_a_checkpoint_moves_from_8_devices_fsdp_to_4_devices_tp(tmp_path):
    path = str(tmp_path / "ck")
    saved = script_json(SCRIPT, "save", path, "data=8", "fsdp", devices=8)
    back = script_json(SCRIPT, "restore", path, "model=4", "tp", devices=4)
    assert saved["spec"] == "P(None, None, 'data')"
    assert back["spec"] == "P(None, 'model')" and back["devices"] == 4
    # equal values (the sums of every array, in float64)
    np.testing.assert_array_equal(back["sum"], saved["sum"])
    # and training continues as the unbroken run did (another layout: rounding)
    np.testing.assert_allclose(back["losses"], saved["losses"][5:], rtol=1e-5)
