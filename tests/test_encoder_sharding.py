"""`load_pretrained(path, sharding=...)` for the encoder families' folders (BERT,
ModernBERT, ViT, T5): each parameter lands on the sharding asked for (a
`Sharding`, or a function of the parameter's path, as for the decoders), its
values are the stored ones, and the outputs equal the unsharded model's.

The models are blocklab's own, built from `config.json` fields through each
family's `to_config` and saved with `save_pretrained` (no torch). Several
devices need a fresh process (the device count is fixed when JAX starts):
`XLA_FLAGS=--xla_force_host_platform_device_count=2`, in which `import torch`
fails; in this process, a single-device sharding checks the paths asked for.
"""

from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import equinox as eqx
import jax
import numpy as np
import pytest
from _procs import run

from blocklab._validate import ConfigError

#: `(module, to_config, class, config.json fields)` of one small model per family.
MODELS = {
    "bert": (
        "bert", "bert_config", "BertModel",
        dict(vocab_size=40, hidden_size=16, num_hidden_layers=2,
             num_attention_heads=4, intermediate_size=24,
             max_position_embeddings=16),
    ),
    "vit": (
        "vit", "vit_config", "ViTForImageClassification",
        dict(hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=24, image_size=8, patch_size=4, num_labels=3),
    ),
    "modernbert": (
        "modernbert", "modernbert_config", "ModernBertForMaskedLM",
        dict(vocab_size=40, hidden_size=16, intermediate_size=24,
             num_hidden_layers=3, num_attention_heads=4, local_attention=4,
             pad_token_id=0),
    ),
    "t5": (
        "t5", "t5_config", "T5ForConditionalGeneration",
        dict(vocab_size=40, d_model=16, d_kv=4, d_ff=24, num_layers=2,
             num_decoder_layers=1, num_heads=4, feed_forward_proj="gated-gelu",
             decoder_start_token_id=0, relative_attention_num_buckets=8,
             relative_attention_max_distance=16),
    ),
}  # fmt: skip


def _model(name):
    import importlib

    module, fn, cls, fields = MODELS[name]
    to_config = getattr(
        importlib.import_module(f"blocklab.interop.families.{module}"), fn
    )
    fam_build = importlib.import_module("blocklab.interop.hf_common")
    fam = next(f for f in fam_build.FAMILIES.values() if cls in f.classes)
    cfg = to_config(types.SimpleNamespace(**fields), cls)
    return fam.build(cfg, key=jax.random.key(1))


def test_sharding_single_device_and_function(tmp_path):
    """In this process: every parameter is placed where the function says,
    the paths asked for are the decoders' (layer axis first, no index),
    values are the stored ones; a bad sharding is refused by name."""
    import blocklab

    model = _model("bert")
    folder = blocklab.save_pretrained(model, tmp_path / "m")
    dev = jax.devices()[-1]
    seen = []

    def where(path):
        seen.append(path)
        return jax.sharding.SingleDeviceSharding(dev)

    loaded = blocklab.load_pretrained(folder, sharding=where)
    assert "stack.blocks.attention.W_q.weight" in seen
    assert {"token_emb.weight", "pooler_dense.weight"} <= set(seen)
    assert not any(".0." in p or ".1." in p for p in seen)
    params = eqx.filter(loaded, eqx.is_inexact_array)
    for leaf in jax.tree_util.tree_leaves(params):
        assert leaf.devices() == {dev}
    for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ConfigError, match="sharding"):
        blocklab.load_pretrained(folder, sharding="fsdp")
    with pytest.raises(ConfigError, match=r"sharding\('token_emb.weight'\)"):
        blocklab.load_pretrained(folder, sharding=lambda path: 3)


MESH_SCRIPT = textwrap.dedent(
    """
    import json, sys
    class Block:  # `import torch` fails in this process
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError("torch is blocked in this test")
            return None
    sys.meta_path.insert(0, Block())
    import numpy as np, jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import blocklab
    sys.path.insert(0, sys.argv[3])
    from test_encoder_sharding import _model

    assert len(jax.devices()) == 2, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("model",))
    rows, asked = NamedSharding(mesh, P(None, "model", None)), []

    def where(path):  # each stacked W_q split over its rows, the rest replicated
        asked.append(path)
        if path.endswith("blocks.attention.W_q.weight"):
            return rows
        return NamedSharding(mesh, P())

    rng = np.random.default_rng(0)
    for i, name in enumerate(sys.argv[2].split(",")):
        model = _model(name)
        folder = blocklab.save_pretrained(model, f"{sys.argv[1]}/{name}")
        plain = blocklab.load_pretrained(folder)
        m = blocklab.load_pretrained(folder, sharding=where)
        for s in ("stack", "encoder", "decoder"):
            if not hasattr(m, s):
                continue
            wq = getattr(m, s).blocks.attention.W_q.weight
            assert wq.sharding.spec == P(None, "model", None), (s, wq.sharding)
            assert len(wq.addressable_shards) == 2
            L, out, d = wq.shape
            assert wq.addressable_shards[0].data.shape == (L, out // 2, d)
        for a, b in zip(jax.tree.leaves(model), jax.tree.leaves(m), strict=True):
            assert np.array_equal(np.asarray(a), np.asarray(b)), name
        if name == "vit":
            x = rng.normal(size=(2, 3, 8, 8)).astype(np.float32)
            run = lambda mm: mm.classify(images=x)
        elif name == "t5":
            src, tgt = rng.integers(0, 40, (2, 7)), rng.integers(0, 40, (2, 5))
            run = lambda mm: mm(src, tgt)
        else:
            ids, mask = rng.integers(0, 40, (2, 9)), np.ones((2, 9), bool)
            mask[1, 6:] = False
            run = lambda mm: mm(ids, key_mask=mask)
        want = np.asarray(run(plain))  # a sharded matmul sums in another order
        got = np.asarray(run(m))
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= 1e-5 * scale, name
    assert not any(n == "torch" or n.startswith("torch.") for n in sys.modules)
    print(json.dumps(sorted(set(asked))))
    """
)


@pytest.mark.parametrize(
    "names",
    ["bert", pytest.param("t5,vit,modernbert", marks=pytest.mark.slow)],
)
def test_sharded_over_a_mesh(tmp_path, names):
    """On 2 simulated devices, without torch: each stacked W_q split over its
    rows lands so (2 shards of half the rows), the rest replicated, the
    values are the stored ones and the outputs equal the unsharded load's."""
    script = tmp_path / "mesh.py"
    script.write_text(MESH_SCRIPT)
    tests = str(Path(__file__).parent)
    code, out, err = run(
        [sys.executable, str(script), str(tmp_path), names, tests],
        env={"XLA_FLAGS": "--xla_force_host_platform_device_count=2"},
        timeout=600,
    )
    assert code == 0, err[-3000:]
