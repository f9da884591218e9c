"""Sweeps of every `DecoderLM` family: each member equals its own `train_model` run.

A decoder stores per-layer data (the RoPE base, the attention window) as
integer leaves of its scanned stack. A sweep checks its loss on a model
skeleton built by `eqx.filter_eval_shape`, where those leaves are
`ShapeDtypeStruct`s; they must be traced as arguments, not closed over
(issue 23, item 0: Llama failed with `pow got incompatible shapes`, Gemma 3
with `DynamicJaxprTracer - ShapeDtypeStruct`).
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _procs import script_json

from blocklab import RunConfig, SweepConfig
from blocklab.data.datasets import TokenDataset
from blocklab.diagnostics.propagation import signal_stats
from blocklab.models import DecoderConfig, DecoderLM, MoEDecoderConfig
from blocklab.training.losses import lm_loss
from blocklab.training.member_axis import sharded_map
from blocklab.training.run import train_model
from blocklab.training.step import init_state
from blocklab.training.sweep import sweep_optimizer, train_sweep

STEPS, SPC, BATCH, SEQ = 3, 2, 4, 8
MODEL_SEEDS, DATA_SEEDS, LRS = [0, 1], [5, 6], [1e-3, 1e-2]

CONFIGS = {
    "gpt2": lambda: DecoderConfig.gpt2(32, 16, 2, 2, max_len=SEQ),
    "llama": lambda: DecoderConfig.llama(32, 16, 2, 2, max_len=SEQ),
    "olmo2": lambda: DecoderConfig.olmo2(32, 16, 2, 2, max_len=SEQ),
    "gemma3": lambda: DecoderConfig.gemma3(
        32, 16, 2, 2, head_dim=8, window=3, global_every=2, max_len=SEQ
    ),
    "mixtral": lambda: MoEDecoderConfig.mixtral(
        32, 16, 2, 2, num_experts=4, top_k=2, max_len=SEQ
    ),
}
# Llama is the case of the report and stays in the fast run; every family
# compiles its own sweep and reference, so the others are slow.
FAMILIES = [
    pytest.param(name, marks=() if name == "llama" else pytest.mark.slow)
    for name in CONFIGS
]


@pytest.fixture(scope="module")
def data():
    tokens = (np.arange(400) * 7) % 31
    return TokenDataset(tokens, seq_len=SEQ, num_train=120, num_val=8)


def _reference(cfg, data, k):
    """Member k trained alone by `train_model` (the sweep's optimizer, its lr)."""
    model = DecoderLM(cfg, key=jax.random.key(MODEL_SEEDS[k]))
    optimizer = sweep_optimizer(optax.adamw, weight_decay=0.0)
    state = init_state(model, optimizer)
    state.opt_state.hyperparams["learning_rate"] = jnp.float32(LRS[k])
    return train_model(
        model,
        data,
        optimizer,
        STEPS,
        key=jax.random.key(DATA_SEEDS[k]),
        state=state,
        run=RunConfig(batch_size=BATCH, steps_per_call=SPC, progress=False),
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_every_member_equals_its_own_train_model_run(family, data):
    cfg = CONFIGS[family]()
    res = train_sweep(
        lambda k: DecoderLM(cfg, key=k),
        data,
        STEPS,
        model_keys=MODEL_SEEDS,
        data_keys=DATA_SEEDS,
        run=RunConfig(batch_size=BATCH, steps_per_call=SPC, progress=False),
        sweep=SweepConfig(learning_rates=LRS),
    )
    assert res.losses.shape == (2, STEPS)
    np.testing.assert_array_equal(res.diverged_at, 0)
    for k in range(2):
        ref = _reference(cfg, data, k)
        np.testing.assert_allclose(res.losses[k], ref.losses, rtol=1e-5, atol=0)
        np.testing.assert_allclose(res.val_loss[k], ref.val_loss, rtol=1e-5, atol=0)
        # The final models compute the same logits. (Their weights are not
        # compared one by one: a leaf whose gradient is zero in exact
        # arithmetic, such as GPT-2's key bias under the softmax, moves by
        # Adam-normalized rounding noise of size lr in both runs.)
        X, _ = data.val_batch()
        got, want = res.model(k)(X), ref.model(X)
        scale = float(jnp.abs(want).max())
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
        for a, b in zip(
            jax.tree_util.tree_leaves(res.model(k)),
            jax.tree_util.tree_leaves(ref.model),
            strict=True,
        ):
            if jnp.issubdtype(jnp.result_type(b), jnp.integer):
                np.testing.assert_array_equal(a, b)  # per-layer RoPE base, window
    # The two learning rates take the members to different places.
    assert not np.allclose(res.losses[0, -1], res.losses[1, -1])


@pytest.mark.parametrize(
    "family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)]
)
def test_sharded_map_of_a_decoder_equals_a_loop_over_seeds(family, data):
    cfg = CONFIGS[family]()
    X, Y = data.val_batch()

    def loss(key):
        return lm_loss(DecoderLM(cfg, key=key), X, Y)

    mapped = sharded_map(loss, [3, 4, 5])
    loop = [float(loss(jax.random.key(s))) for s in (3, 4, 5)]
    np.testing.assert_allclose(np.asarray(mapped), loop, rtol=1e-5, atol=0)


@pytest.mark.parametrize(
    "family", ["llama", pytest.param("gemma3", marks=pytest.mark.slow)]
)
def test_signal_stats_of_decoder_stacks_map_over_seeds_as_a_loop(family):
    """The signal diagnostics' seed axis (`sharded_map`, as `signal_sweep` uses
    it) over a decoder's stack, whose per-layer RoPE base and window are data."""
    cfg = CONFIGS[family]()

    def stats(key):
        model_key, x_key, r_key = jax.random.split(key, 3)
        stack = DecoderLM(cfg, key=model_key).stack
        X = jax.random.normal(x_key, (2, SEQ, 16), jnp.float32)
        return signal_stats(stack, X, r_key)

    mapped = sharded_map(stats, [0, 1])
    for k in range(2):
        one = stats(jax.random.key(k))
        for name in ("stream_rms", "c_attn", "max_logit"):
            np.testing.assert_allclose(
                np.asarray(getattr(mapped, name))[k],
                getattr(one, name),
                rtol=1e-5,
                atol=1e-7,
                err_msg=name,
            )


@pytest.mark.slow
def test_a_converted_llama_sweeps_like_its_own_run(data):
    """Fine-tuning one converted `transformers` Llama at two learning rates."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from blocklab.interop.huggingface import from_huggingface

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=32, hidden_size=16, intermediate_size=32,
            num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2,
            max_position_embeddings=SEQ,
        )
    )  # fmt: skip
    converted = from_huggingface(hf.eval())
    res = train_sweep(
        lambda k: converted,
        data,
        STEPS,
        model_keys=[0, 0],
        data_keys=DATA_SEEDS,
        run=RunConfig(batch_size=BATCH, steps_per_call=SPC, progress=False),
        sweep=SweepConfig(learning_rates=LRS),
    )
    optimizer = sweep_optimizer(optax.adamw, weight_decay=0.0)
    for k in range(2):
        state = init_state(converted, optimizer)
        state.opt_state.hyperparams["learning_rate"] = jnp.float32(LRS[k])
        ref = train_model(
            converted,
            data,
            optimizer,
            STEPS,
            key=jax.random.key(DATA_SEEDS[k]),
            state=state,
            run=RunConfig(batch_size=BATCH, steps_per_call=SPC, progress=False),
        )
        np.testing.assert_allclose(res.losses[k], ref.losses, rtol=1e-5, atol=0)


# Runs in a subprocess: the device count is fixed when JAX starts.
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import jax
    import numpy as np
    from blocklab.data.datasets import TokenDataset
    from blocklab.models import MoEDecoderConfig
    from blocklab.models import DecoderConfig, DecoderLM
    from blocklab.training.sweep import train_sweep
    from blocklab import RunConfig, SweepConfig

    data = TokenDataset((np.arange(400) * 7) % 31, seq_len=8, num_train=120, num_val=8)
    cfgs = {
        "llama": DecoderConfig.llama(32, 16, 2, 2, max_len=8),
        "gemma3": DecoderConfig.gemma3(
            32, 16, 2, 2, head_dim=8, window=3, global_every=2, max_len=8
        ),
        "mixtral": MoEDecoderConfig.mixtral(
            32, 16, 2, 2, num_experts=4, top_k=2, max_len=8
        ),
    }
    out = {"devices": len(jax.devices())}
    for name, cfg in cfgs.items():
        res = train_sweep(
            lambda k: DecoderLM(cfg, key=k), data, 3, model_keys=[0, 1, 2],
            data_keys=[5, 6, 7],
            run=RunConfig(batch_size=4, steps_per_call=2, progress=False),
            sweep=SweepConfig(learning_rates=[1e-3, 1e-2, 3e-3]),
        )
        out[name] = {"losses": res.losses.tolist(), "val": res.val_loss.tolist()}
    print(json.dumps(out))
    """
)


@pytest.mark.slow
def test_two_devices_sweep_every_rope_family_as_one_device_does():
    one, two = (script_json(SCRIPT, devices=n) for n in (1, 2))
    assert (one["devices"], two["devices"]) == (1, 2)
    for name in ("llama", "gemma3", "mixtral"):
        # K = 3 members padded to 4 over two devices; the padding is dropped.
        assert np.asarray(two[name]["losses"]).shape == (3, 3)
        for field in ("losses", "val"):
            np.testing.assert_allclose(
                two[name][field], one[name][field], rtol=1e-5, err_msg=name
            )
