"""Head-less encoders against `transformers`: `BertModel` (with and without its
pooler), `ModernBertModel` and `ViTModel` as feature extractors
(`last_hidden_state`, `pooler_output`), their folders both ways, and a folder
of one class read as another class of its family (`model_class=`).

Models are built from configs with random weights (nothing downloads) and
compared in float32 at <= 1e-5 times the outputs' scale, on the non-padded
rows of a right-padded batch.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_hf_encoders import _bert, _close, _modernbert, _ragged, _vit

from blocklab._validate import ConfigError
from blocklab.training.checkpoint import CheckpointError


def _base(name, seed, pooler=True):
    """A random `transformers` base model of family `name` and its inputs
    (keyword arguments of the PyTorch call) with a padding mask."""
    import torch
    import transformers
    from hf_models import randomize

    if name == "vit":
        head, rng = _vit(seed)
        model = transformers.ViTModel(head.config, add_pooling_layer=pooler)
        c = head.config
        x = rng.normal(size=(3, c.num_channels, c.image_size, c.image_size))
        inputs = {"pixel_values": torch.tensor(x.astype(np.float32))}
        mask = None
    else:
        if name == "bert":
            head, rng = _bert("BertForMaskedLM", seed)
            model = transformers.BertModel(head.config, add_pooling_layer=pooler)
        else:
            head, rng = _modernbert("ModernBertForMaskedLM", seed)
            model = transformers.ModernBertModel(head.config)
        T = int(rng.integers(4, 12))
        if name == "bert":
            T = min(T, head.config.max_position_embeddings)
        ids, mask = _ragged(rng, 3, T, head.config.vocab_size)
        inputs = {
            "input_ids": torch.tensor(ids),
            "attention_mask": torch.tensor(mask.astype(np.int64)),
        }
    return randomize(model, seed=seed, embeddings=1.0), inputs, mask


def _hf_out(model, inputs):
    import torch

    with torch.no_grad():
        out = model(**inputs)
    pooled = getattr(out, "pooler_output", None)
    return out.last_hidden_state.numpy(), None if pooled is None else pooled.numpy()


def _ours(model, inputs, mask):
    """(last_hidden_state, pooler_output or None) of a blocklab base model."""
    if "pixel_values" in inputs:
        h = model(images=jnp.asarray(inputs["pixel_values"].numpy()))
    else:
        h = model(jnp.asarray(inputs["input_ids"].numpy()), key_mask=jnp.asarray(mask))
    pooled = model.pooler_output(h) if model.pooler_dense is not None else None
    return h, pooled


def _check(ours, want, mask):
    (h, p), (wh, wp) = ours, want
    _close(h, wh, mask)
    assert (p is None) == (wp is None)
    if wp is not None:
        _close(p, wp)


# from_huggingface ----------------------------------------------------------------


@pytest.mark.parametrize(
    "name,pooler,seed",
    [
        ("bert", True, 0),
        pytest.param("bert", False, 1, marks=pytest.mark.slow),
        pytest.param("bert", True, 2, marks=pytest.mark.slow),
        pytest.param("vit", True, 0, marks=pytest.mark.slow),
        pytest.param("vit", False, 1, marks=pytest.mark.slow),
        pytest.param("modernbert", True, 0, marks=pytest.mark.slow),
        pytest.param("modernbert", True, 1, marks=pytest.mark.slow),
    ],
)
def test_base_model_outputs(name, pooler, seed):
    """last_hidden_state (and pooler_output where the model has a pooler)
    equal transformers' on a padded batch; the pooler is there iff it is."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import blocklab

    hf, inputs, mask = _base(name, seed, pooler)
    ours = blocklab.from_huggingface(hf)
    assert ours.mlm_dense is None and ours.classifier is None
    _check(_ours(ours, inputs, mask), _hf_out(hf, inputs), mask)


def test_vit_model_outputs():
    """ViTModel with its pooler (the default suite's ViT case)."""
    pytest.importorskip("torch")
    import blocklab

    hf, inputs, _ = _base("vit", 3, True)
    _check(
        _ours(blocklab.from_huggingface(hf), inputs, None), _hf_out(hf, inputs), None
    )


# folders -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,pooler",
    [
        ("bert", False),
        pytest.param("bert", True, marks=pytest.mark.slow),
        pytest.param("vit", True, marks=pytest.mark.slow),
        pytest.param("vit", False, marks=pytest.mark.slow),
        pytest.param("modernbert", True, marks=pytest.mark.slow),
    ],
)
def test_base_folders_both_ways(tmp_path, name, pooler):
    """transformers' folder -> load_pretrained -> save_pretrained ->
    transformers' AutoModel: equal outputs at each step. Without a pooler,
    no pooler.dense.* is stored and transformers' own pooler would be
    random, so only last_hidden_state is compared there."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    import blocklab

    hf, inputs, mask = _base(name, 4, pooler)
    want = _hf_out(hf, inputs)
    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    got = _ours(ours, inputs, mask)
    _check(got, want if pooler or name == "modernbert" else (want[0], None), mask)
    out = blocklab.save_pretrained(ours, tmp_path / "ours")
    with safe_open(out / "model.safetensors", "np") as f:
        assert ("pooler.dense.weight" in f.keys()) == (ours.pooler_dense is not None)
    back = transformers.AutoModel.from_pretrained(out).eval()
    assert type(back).__name__ == type(hf).__name__
    again = _hf_out(back, inputs)
    _close(again[0], got[0], mask)
    if got[1] is not None:
        _close(again[1], got[1])


_BERT_FIELDS = dict(
    vocab_size=30, hidden_size=8, num_hidden_layers=2, num_attention_heads=2,
    intermediate_size=12, max_position_embeddings=16,
)  # fmt: skip


@pytest.fixture(scope="module")
def base_bert():
    """A blocklab BertModel (with its pooler) built from a config.json's fields."""
    import types

    from blocklab.interop.families.bert import bert_config
    from blocklab.models.encoder import EncoderModel

    cfg = bert_config(types.SimpleNamespace(**_BERT_FIELDS), "BertModel")
    assert cfg.pooler == "tanh" and not cfg.mlm_head and cfg.num_labels == 0
    return EncoderModel(cfg, key=jax.random.key(0))


def test_base_state_dicts_both_ways(base_bert):
    """to_huggingface_state_dict of a BertModel-shaped model has exactly
    transformers' BertModel keys and shapes; load_huggingface_state_dict
    takes it back bit for bit."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("torch")
    from blocklab.interop import load_huggingface_state_dict, to_huggingface_state_dict

    hf = transformers.BertModel(transformers.BertConfig(**_BERT_FIELDS))
    model, cfg = base_bert, base_bert.cfg
    sd = to_huggingface_state_dict(model)
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    assert {k: v.shape for k, v in sd.items()} == want
    back = load_huggingface_state_dict(cfg, sd)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# another class of the family -----------------------------------------------------


@pytest.mark.parametrize(
    "head_cls,base_cls",
    [
        ("BertForMaskedLM", "BertModel"),
        pytest.param(
            "BertForSequenceClassification", "BertModel", marks=pytest.mark.slow
        ),
        pytest.param(
            "ModernBertForMaskedLM", "ModernBertModel", marks=pytest.mark.slow
        ),
        pytest.param("ViTForImageClassification", "ViTModel", marks=pytest.mark.slow),
    ],
)
def test_head_folder_read_as_base_model(tmp_path, head_cls, base_cls):
    """A head class's folder read with model_class=<base class> gives what
    transformers' <base class>.from_pretrained(folder) gives: the encoder's
    states, the head left out. A pooler is read where the folder stores one
    (BertForSequenceClassification); where it does not, transformers draws
    one at random and blocklab's model has none."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    name = {"Bert": "bert", "Mode": "modernbert", "ViTF": "vit"}[head_cls[:4]]
    maker = {"bert": _bert, "modernbert": _modernbert}.get(name)
    head, rng = maker(head_cls, 6) if maker else _vit(6)
    head.save_pretrained(tmp_path / "head")
    hf = getattr(transformers, base_cls).from_pretrained(tmp_path / "head").eval()
    _, inputs, mask = _base(name, 6)  # the same config and inputs
    ours = blocklab.load_pretrained(tmp_path / "head", model_class=base_cls)
    assert ours.mlm_dense is None and ours.classifier is None
    stored_pooler = head_cls == "BertForSequenceClassification"
    assert (ours.pooler_dense is not None) == stored_pooler
    got, want = _ours(ours, inputs, mask), _hf_out(hf, inputs)
    _check(
        got, want if stored_pooler or name == "modernbert" else (want[0], None), mask
    )


def test_missing_heads_refused_by_name(tmp_path, base_bert):
    """A base folder read as a head class: the head's tensors are not stored
    (transformers would draw them at random): refused, naming them; a class
    of another family, and model_class= on a decoder folder, are refused."""
    import json

    import blocklab

    folder = blocklab.save_pretrained(base_bert, tmp_path / "base")
    with pytest.raises(CheckpointError, match=r"cls\.predictions\.transform\.dense"):
        blocklab.load_pretrained(folder, model_class="BertForMaskedLM")
    with pytest.raises(CheckpointError, match=r"'classifier\.weight'.*random"):
        blocklab.load_pretrained(folder, model_class="BertForSequenceClassification")
    with pytest.raises(ConfigError, match=r"model_class='ViTModel'.*BertModel"):
        blocklab.load_pretrained(folder, model_class="ViTModel")
    dec = tmp_path / "dec"
    dec.mkdir()
    (dec / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    )
    with pytest.raises(ConfigError, match="model_class= is for the encoder"):
        blocklab.load_pretrained(dec, model_class="BertModel")


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(pooler_act="relu"), "pooler_act"),
        (dict(pooler_output_size=12), "pooler_output_size"),
    ],
)
def test_vit_model_pooler_fields_refused_by_name(fields, name):
    transformers = pytest.importorskip("transformers")
    from blocklab.interop.families.vit import vit_config

    base = dict(hidden_size=8, num_attention_heads=2, image_size=8, patch_size=4)
    vit_config(transformers.ViTConfig(**base), "ViTModel")  # the base converts
    with pytest.raises(ConfigError, match=name):
        vit_config(transformers.ViTConfig(**base, **fields), "ViTModel")


def test_bad_inputs_refused_by_name(base_bert, plain_python):
    """Per-token inputs of another shape, positions past the learned table,
    images to a token model, and pooler_output without a pooler are refused
    (ConfigError naming the argument), not broadcast or clamped; without the
    suite's type checker, as users run."""
    import dataclasses

    import equinox as eqx

    from blocklab.models.encoder import EncoderModel

    ids = np.zeros((2, 7), np.int32)
    with pytest.raises(ConfigError, match=r"token_type_ids must have .*\(2, 5\)"):
        base_bert(ids, token_type_ids=np.zeros((2, 5), np.int32))
    with pytest.raises(ConfigError, match=r"positions must have .*\(5,\)"):
        base_bert(ids, positions=np.arange(5))
    with pytest.raises(ConfigError, match=r"positions must lie in \[0, max_len=16\)"):
        base_bert(ids, positions=np.arange(7) + 10)
    with pytest.raises(ConfigError, match="images"):
        base_bert(ids, images=np.zeros((2, 3, 8, 8), np.float32))
    cfg = dataclasses.replace(base_bert.cfg, pooler="none")
    bare = eqx.filter_eval_shape(lambda k: EncoderModel(cfg, key=k), jax.random.key(0))
    with pytest.raises(ConfigError, match="no pooler"):
        bare.pooler_output(jnp.zeros((7, 8)))
