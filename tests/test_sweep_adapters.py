"""`train_sweep` from one given model, and over adapters on one shared base
(issue 37 section 5, issue 33 item 5).

References: each member against its own `train_model` run, started from the
same model (or from `lora(base, rank=r)` unmasked, at the member's own rank);
the shared base against the bytes of the compiled program's
`memory_analysis()`, which a sweep holding K bases would exceed K-fold.
"""

from dataclasses import replace

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from blocklab import LoRAConfig, RunConfig, SweepConfig
from blocklab._validate import ConfigError
from blocklab.models.decoder import DecoderLM
from blocklab.models.decoder_config import DecoderConfig
from blocklab.nn.lora import (
    LoRALinear,
    MaskedLoRALinear,
    lora,
    lora_layers,
    lora_optimizer,
    mask_lora,
    unmask_lora,
    unmerge_lora,
)
from blocklab.training.run import train_model
from blocklab.training.sweep import sweep_optimizer, train_sweep

TARGETS = ["q", "v", "down"]


def _model(d=32, vocab=64, num_blks=2):
    cfg = DecoderConfig.llama(vocab, d, 4, num_blks, num_kv_heads=2)
    return DecoderLM(cfg, key=jax.random.key(0))


def _batches(key):
    ids = jax.random.randint(key, (4, 9), 0, 64)
    return ids[:, :-1], ids[:, 1:]


def _arrays(tree):
    return jax.tree.leaves(eqx.filter(tree, eqx.is_array))


def _assert_trees_close(a, b, atol):
    la, lb = _arrays(a), _arrays(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb, strict=True):
        assert x.shape == y.shape
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=atol)


@pytest.mark.slow  # CI time; the adapter sweeps below start from a model too
def test_sweep_from_a_model_equals_single_runs_from_it():
    """Every member starts from the model given (a stand-in for a loaded
    checkpoint): member k equals `train_model(model, ...)` at its rate and
    data key; `model_keys` are refused with a model."""
    base = _model()
    rates = [0.1, 0.3]
    # SGD: an update linear in the gradient, so the batched matmuls' rounding
    # stays rounding (Adam magnifies it on near-zero gradients)
    res = train_sweep(
        base,
        _batches,
        3,
        data_keys=[4, 5],
        run=RunConfig(progress=False),
        sweep=SweepConfig(learning_rates=rates, optimizer=sweep_optimizer(optax.sgd)),
    )
    assert res.model_seeds is None and list(res.data_seeds) == [4, 5]
    one = train_model(
        base,
        _batches,
        optax.sgd(rates[1]),
        3,
        key=jax.random.key(5),
        run=RunConfig(progress=False),
    )
    np.testing.assert_allclose(res.losses[1], one.losses, rtol=1e-5)
    _assert_trees_close(res.model(1), one.model, atol=1e-6)
    # the two members really differ (rates and data), and moved off the base
    assert not np.allclose(res.losses[0], res.losses[1])
    assert not np.allclose(_arrays(res.model(0))[0], _arrays(base)[0])
    with pytest.raises(ConfigError, match="model_keys were given with a model"):
        train_sweep(
            base,
            _batches,
            1,
            model_keys=[0],
            data_keys=[0],
            run=RunConfig(progress=False),
            sweep=SweepConfig(learning_rates=1e-2),
        )
    with pytest.raises(ConfigError, match="model_keys is required with make_model"):
        train_sweep(
            lambda k: base,
            _batches,
            1,
            data_keys=[0],
            run=RunConfig(progress=False),
            sweep=SweepConfig(learning_rates=1e-2),
        )


def test_adapter_sweep_members_equal_their_own_rank_runs():
    """Ranks 2 and 4 (masked to 4), two rates and seeds in one program: each
    member equals `train_model` of the true (unmasked) rank-r adapter
    `lora(base, rank=r, key=model_keys[k])` with `lora_optimizer`; the base
    comes back bit for bit; `model(k)` has rank r."""
    base = _model()
    ranks, rates, seeds = [2, 4], [3e-2, 1e-2], [0, 1]
    res = train_sweep(
        base,
        _batches,
        3,
        model_keys=seeds,
        data_keys=seeds,
        run=RunConfig(progress=False),
        sweep=SweepConfig(
            learning_rates=rates,
            adapters=[LoRAConfig(rank=r, alpha=8.0, targets=TARGETS) for r in ranks],
        ),
    )
    assert list(res.ranks) == ranks
    assert res.select(rank=2).num_members == 1
    # the members' state holds their adapters (and ranks) only, not the base
    node = res.state.model.stack.blocks.attention.W_q
    assert isinstance(node, MaskedLoRALinear) and node.base.weight is None
    assert res.state.model.stack.blocks.ffn.W_1.weight is None
    assert res.base.stack.blocks.attention.W_q.A is None
    # member 0 is masked (rank 2 of 4): against its true rank-2 run; member 1
    # (the largest rank, nothing masked) is checked in the slow test below
    start = lora(
        base, LoRAConfig(rank=2, alpha=8.0, targets=TARGETS), key=jax.random.key(0)
    )
    one = train_model(
        start,
        _batches,
        lora_optimizer(optax.adamw(rates[0], weight_decay=0.0)),
        3,
        key=jax.random.key(seeds[0]),
        run=RunConfig(progress=False),
    )
    np.testing.assert_allclose(res.losses[0], one.losses, rtol=1e-5)
    got = res.model(0)
    node = lora_layers(got)["stack.blocks.attention.W_q"]
    assert isinstance(node, LoRALinear) and node.rank == 2
    assert node.A.shape == (2, 2, 32) and node.scale == 8.0 / 2
    _assert_trees_close(got, one.model, atol=3e-5)
    got_base, _ = unmerge_lora(got)
    for a, b in zip(_arrays(got_base), _arrays(base), strict=True):
        np.testing.assert_array_equal(a, b)
    assert lora_layers(res.model(1))["stack.blocks.ffn.W_2"].A.shape[:2] == (2, 4)
    # the padded rank of the rank-2 member stayed exactly zero
    padded = res.state.model.stack.blocks.attention.W_q
    np.testing.assert_array_equal(padded.A[0, :, 2:, :], 0.0)
    np.testing.assert_array_equal(padded.B[0, :, :, 2:], 0.0)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [1, 3])
def test_adapter_sweep_members_of_every_rank_equal_their_runs(rank):
    """Ranks 1, 3 and 4 in one sweep (seeds and rates differing): the member of
    rank `rank` equals its own rank-`rank` train_model run."""
    base = _model()
    ranks, rates, seeds = [1, 3, 4], [3e-2, 1e-2, 2e-2], [2, 0, 1]
    res = train_sweep(
        base,
        _batches,
        3,
        model_keys=seeds,
        data_keys=seeds,
        run=RunConfig(progress=False),
        sweep=SweepConfig(
            learning_rates=rates,
            adapters=[
                LoRAConfig(rank=r, alpha=5.0, targets=TARGETS, use_rslora=True)
                for r in ranks
            ],
        ),
    )
    k = ranks.index(rank)
    start = lora(
        base,
        LoRAConfig(rank=rank, alpha=5.0, targets=TARGETS, use_rslora=True),
        key=jax.random.key(seeds[k]),
    )
    one = train_model(
        start,
        _batches,
        lora_optimizer(optax.adamw(rates[k], weight_decay=0.0)),
        3,
        key=jax.random.key(seeds[k]),
        run=RunConfig(progress=False),
    )
    np.testing.assert_allclose(res.losses[k], one.losses, rtol=1e-5)
    _assert_trees_close(res.model(k), one.model, atol=3e-5)
    assert res.select(rank=rank).num_members == 1


def test_mask_lora_round_trips_and_keeps_outputs():
    """A rank-2 adapter masked to rank 5 gives the same logits (random B) and
    `unmask_lora` gives the adapter back exactly."""
    base = _model()
    adapted = lora(
        base,
        LoRAConfig(rank=2, alpha=3.0, targets=["q", "up"], use_rslora=True),
        key=jax.random.key(1),
    )
    node = adapted.stack.blocks.ffn.W_1
    B = 0.3 * jax.random.normal(jax.random.key(2), node.B.shape)
    adapted = eqx.tree_at(lambda m: m.stack.blocks.ffn.W_1.B, adapted, B)
    masked = mask_lora(adapted, 5)
    assert masked.stack.blocks.ffn.W_1.A.shape == (2, 5, 32)
    ids = jnp.arange(10) % 64
    np.testing.assert_allclose(masked(ids), adapted(ids), rtol=1e-5, atol=1e-5)
    back = unmask_lora(masked)
    for a, b in zip(_arrays(back), _arrays(adapted), strict=True):
        np.testing.assert_array_equal(a, b)
    assert back.stack.blocks.ffn.W_1.scale == 3.0 / np.sqrt(2)
    with pytest.raises(ConfigError, match="rank 2 > max_rank=1"):
        mask_lora(adapted, 1)


def _nbytes(tree):
    return sum(a.size * a.dtype.itemsize for a in _arrays(tree))


def _small_batches(key):
    ids = jax.random.randint(key, (2, 5), 0, 256)
    return ids[:, :-1], ids[:, 1:]


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_adapter_sweep_holds_the_base_once():
    """K = 8 adapters on a base of 6.3 MB (activations of 8 tokens are small
    beside it): the compiled chunk's arguments hold the base once (K copies
    would be 8x), and arguments, outputs and temporaries together stay under
    half of K bases (`memory_analysis()` of the program that ran)."""
    base = _model(d=256, vocab=256)
    base_bytes = _nbytes(base)
    K = 8
    res = train_sweep(
        base,
        _small_batches,
        1,
        model_keys=list(range(K)),
        data_keys=list(range(K)),
        run=RunConfig(progress=False),
        sweep=SweepConfig(
            learning_rates=1e-2,
            validate=False,
            adapters=LoRAConfig(rank=4, alpha=8.0, targets=["q"]),
            memory_analysis=True,
        ),
    )
    mem = res.memory
    assert base_bytes <= mem["argument"] < 1.1 * base_bytes, (mem, base_bytes)
    assert mem["total"] < K * base_bytes / 2, (mem, base_bytes)
    assert np.all(np.isfinite(res.losses))


@pytest.mark.slow
def test_a_sweep_that_stacks_the_base_holds_it_k_times():
    """The contrast of the test above: the same adapters built by
    `make_model(key)` (each member holding its own base) take at least K
    bases in the compiled program."""
    base = _model(d=256, vocab=256)
    base_bytes = _nbytes(base)
    K = 8

    def make(k):
        return lora(base, LoRAConfig(rank=4, alpha=8.0, targets=["q"]), key=k)

    opt = optax.inject_hyperparams(
        lambda learning_rate: lora_optimizer(optax.adam(learning_rate)),
        hyperparam_dtype=jnp.float32,
    )(learning_rate=1.0)
    res = train_sweep(
        make,
        _small_batches,
        1,
        model_keys=list(range(K)),
        data_keys=list(range(K)),
        run=RunConfig(progress=False),
        sweep=SweepConfig(
            learning_rates=1e-2, optimizer=opt, validate=False, memory_analysis=True
        ),
    )
    assert res.memory["argument"] >= K * base_bytes


def test_adapter_sweep_refusals():
    base = _model()
    kw = dict(data_keys=[0], run=RunConfig(progress=False))
    q = LoRAConfig(rank=2, alpha=1.0, targets=["q"])

    def on(adapters):
        return SweepConfig(learning_rates=1e-2, adapters=adapters)

    with pytest.raises(ConfigError, match="pass the base model itself"):
        train_sweep(lambda k: base, _batches, 1, model_keys=[0], sweep=on(q), **kw)
    with pytest.raises(ConfigError, match="model_keys is required with adapters"):
        train_sweep(base, _batches, 1, sweep=on(q), **kw)
    with pytest.raises(ConfigError, match="LoRAConfig: dropout=0.1 is not supported"):
        LoRAConfig(rank=2, alpha=1.0, targets=["q"], dropout=0.1)
    with pytest.raises(ConfigError, match="has 2 LoRAConfigs but there are K=1"):
        train_sweep(base, _batches, 1, model_keys=[0],
                    sweep=on([q, replace(q, rank=4)]), **kw)  # fmt: skip
    with pytest.raises(ConfigError, match=r"differ in rank only; adapters\[1\].alpha"):
        train_sweep(base, _batches, 1, model_keys=[0, 1], data_keys=[0, 1],
                    run=kw["run"], sweep=on([q, replace(q, alpha=2.0)]))  # fmt: skip
    with pytest.raises(ConfigError, match="target 'x' is not a projection"):
        LoRAConfig(rank=2, alpha=1.0, targets=["x"])
    # a dict of settings (the old form) is refused by SweepConfig itself:
    # tests/test_run_config.py


SHARDED = """
import json
import jax, numpy as np
from blocklab import TimeMachine
from blocklab.models.decoder import DecoderLM
from blocklab.models.decoder_config import DecoderConfig
from blocklab.training.sweep import train_sweep
from blocklab import LoRAConfig, RunConfig, SweepConfig
cfg = DecoderConfig.llama(32, 32, 4, 2, num_kv_heads=2, max_len=16)
base = DecoderLM(cfg, key=jax.random.key(0))
data = TimeMachine(seq_len=16, num_train=2000, num_val=40)
ids = np.arange(16) % 28
res = train_sweep(base, data, 4, model_keys=[0, 1, 2], data_keys=[3, 4, 5],
                  run=RunConfig(batch_size=4, steps_per_call=2, progress=False),
                  sweep=SweepConfig(learning_rates=[1e-2, 2e-2, 3e-2],
                      adapters=[LoRAConfig(rank=r, alpha=8.0, targets=["q", "v"])
                                for r in (2, 4, 8)],
                      probe=lambda m: m(ids).max()))
B = res.state.model.stack.blocks.attention.W_v.B
print(json.dumps({"devices": jax.device_count(), "losses": res.losses.tolist(),
                  "val": res.val_loss.tolist(), "probes": res.probes.tolist(),
                  "B": np.asarray(B).tolist()}))
"""


@pytest.mark.slow
def test_adapter_sweep_on_4_devices_equals_1():
    """K = 3 adapters (padded to 4 members) over 4 simulated devices, with
    validation and a probe: the numbers of one device."""
    from _procs import script_json

    one = script_json(SHARDED, devices=1, timeout=600)
    four = script_json(SHARDED, devices=4, timeout=600)
    assert (one["devices"], four["devices"]) == (1, 4)
    for name in ("losses", "val", "probes"):
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, err_msg=name)
    np.testing.assert_allclose(four["B"], one["B"], rtol=1e-4, atol=1e-6)
    assert np.abs(np.asarray(one["B"])).max() > 1e-3
