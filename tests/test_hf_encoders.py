"""Encoder families against `transformers` (BERT, ModernBERT, ViT), and ViT's
patch embedding against PyTorch's convolution.

Models are built from configs with random weights (nothing downloads) and
compared logit for logit in float32, at ≤ 1e-5 times the logits' scale.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.nn.patch_embed import PatchEmbed, ViTEmbedding, patchify

# Patch embedding ---------------------------------------------------------------


def test_patchify_order_by_loop():
    """Patch n = (row r, column c) holds x[:, pr:pr+p, pc:pc+p] flattened
    (channel, row, column), patches row-major: a NumPy loop."""
    x = np.random.default_rng(0).normal(size=(2, 3, 6, 9)).astype(np.float32)
    p = 3
    got = np.asarray(patchify(jnp.asarray(x), p))
    assert got.shape == (2, 6, 27)
    for b in range(2):
        n = 0
        for r in range(2):
            for c in range(3):
                want = x[b, :, p * r : p * r + p, p * c : p * c + p].reshape(-1)
                np.testing.assert_array_equal(got[b, n], want)
                n += 1


@pytest.mark.parametrize(
    "C,p,d,H,W",
    [(3, 4, 8, 8, 12), pytest.param(1, 2, 5, 6, 6, marks=pytest.mark.slow)],
)
def test_patch_embed_equals_conv2d(C, p, d, H, W):
    torch = pytest.importorskip("torch")
    emb = PatchEmbed(C, p, d, key=jax.random.key(0))
    rng = np.random.default_rng(1)
    bias = rng.normal(size=d).astype(np.float32)
    emb = eqx.tree_at(lambda e: e.bias, emb, jnp.asarray(bias))
    x = rng.normal(size=(2, C, H, W)).astype(np.float32)
    conv = torch.nn.functional.conv2d(
        torch.from_numpy(x),
        torch.from_numpy(np.array(emb.weight)),
        torch.from_numpy(bias),
        stride=p,
    )  # (B, d, H/p, W/p)
    want = conv.flatten(2).transpose(1, 2).numpy()
    got = np.asarray(emb(jnp.asarray(x)))
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    # one image at a time gives the rows of the batch
    np.testing.assert_allclose(
        np.asarray(emb(jnp.asarray(x[1]))), got[1], rtol=0, atol=1e-6
    )


def test_vit_embedding_cls_and_positions():
    """h0 = [cls; patches] + P, by hand from PatchEmbed."""
    emb = ViTEmbedding(8, 4, 3, 6, key=jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (3, 8, 8))
    h = np.asarray(emb(x))
    assert h.shape == (5, 6) and emb.num_patches == 4
    pos = np.asarray(emb.pos_emb)
    np.testing.assert_allclose(h[0], np.asarray(emb.cls_token) + pos[0], atol=1e-6)
    np.testing.assert_allclose(h[1:], np.asarray(emb.patch(x)) + pos[1:], atol=1e-6)


@pytest.mark.parametrize(
    "shape,name",
    [((3, 8, 12), "8x8"), ((2, 8, 8), "8x8")],
)
def test_vit_embedding_refuses_bad_images(shape, name):
    emb = ViTEmbedding(8, 4, 3, 6, key=jax.random.key(2))
    with pytest.raises(ConfigError, match=name):
        emb(jnp.zeros(shape))


def test_patch_embed_refuses_bad_sizes():
    with pytest.raises(ConfigError, match="multiples of patch_size"):
        patchify(jnp.zeros((3, 7, 8)), 4)
    with pytest.raises(ConfigError, match="channels"):
        PatchEmbed(3, 4, 8, key=jax.random.key(0))(jnp.zeros((1, 8, 8)))
    with pytest.raises(ConfigError, match="image_size"):
        ViTEmbedding(10, 4, 3, 8, key=jax.random.key(0))


# Shared helpers ------------------------------------------------------------------


def _close(got, want, where=None):
    """|got - want| <= 1e-5 x the scale of want (rows `where` only)."""
    got, want = np.asarray(got), np.asarray(want)
    if where is not None:
        got, want = got[where], want[where]
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * scale, f"max |diff| {err:.3g} > 1e-5 x scale {scale:.3g}"


def _ragged(rng, B, T, vocab, lo=1):
    """Random ids (B, T) and a right-padding mask with lengths in [lo, T]."""
    ids = rng.integers(0, vocab, size=(B, T))
    lens = rng.integers(lo, T + 1, size=B)
    lens[0] = T
    mask = np.arange(T)[None, :] < lens[:, None]
    return ids, mask


# BERT --------------------------------------------------------------------------


def _bert(cls_name, seed, **fields):
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    rng = np.random.default_rng(seed)
    heads = int(rng.choice([2, 3, 4]))
    hd = int(rng.choice([4, 8]))
    cfg = dict(
        vocab_size=int(rng.integers(20, 60)),
        hidden_size=heads * hd,
        num_hidden_layers=int(rng.integers(1, 4)),
        num_attention_heads=heads,
        intermediate_size=int(rng.integers(8, 50)),
        max_position_embeddings=int(rng.integers(12, 30)),
        type_vocab_size=int(rng.integers(1, 4)),
        layer_norm_eps=float(rng.choice([1e-12, 1e-5])),
    )
    cfg.update(fields)
    model = getattr(transformers, cls_name)(transformers.BertConfig(**cfg))
    return randomize(model, seed=seed, embeddings=1.0), rng


@pytest.mark.parametrize(
    "seed",
    [
        0,
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
    ],
)
def test_bert_mlm_logits(seed):
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _bert("BertForMaskedLM", seed)
    c = hf.config
    B, T = 3, int(rng.integers(2, c.max_position_embeddings + 1))
    ids, mask = _ragged(rng, B, T, c.vocab_size)
    types = rng.integers(0, c.type_vocab_size, size=(B, T))
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            token_type_ids=torch.tensor(types),
        ).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    got = ours(
        jnp.asarray(ids), token_type_ids=jnp.asarray(types), key_mask=jnp.asarray(mask)
    )
    _close(got, want, mask)


@pytest.mark.slow
def test_bert_sequence_classification():
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _bert("BertForSequenceClassification", 3, num_labels=3)
    c = hf.config
    ids, mask = _ragged(rng, 4, 9, c.vocab_size)
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
        ).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    _close(ours.classify(jnp.asarray(ids), key_mask=jnp.asarray(mask)), want)


@pytest.mark.slow
def test_bert_folders_both_ways(tmp_path):
    """transformers' folder -> load_pretrained -> save_pretrained ->
    transformers: equal MLM logits at each step (tied decoder left out)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    hf, rng = _bert("BertForMaskedLM", 5)
    ids, mask = _ragged(rng, 2, 6, hf.config.vocab_size)

    def hf_logits(m):
        with torch.no_grad():
            return m(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask.astype(np.int64)),
            ).logits.numpy()

    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    got = ours(jnp.asarray(ids), key_mask=jnp.asarray(mask))
    _close(got, hf_logits(hf), mask)
    blocklab.save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours")
    _close(hf_logits(back.eval()), got, mask)


def test_a_pretraining_checkpoint_loads_as_its_mlm_class(tmp_path):
    """`bert-base-uncased`'s case: a BertForPreTraining state (pooler and
    next-sentence head included) stored under `architectures`
    BertForMaskedLM loads as transformers loads it (those two left out),
    with equal logits; a tensor of no BERT class is still refused."""
    import json

    from blocklab.training.checkpoint import CheckpointError

    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    pre, rng = _bert("BertForPreTraining", 11)
    pre.save_pretrained(tmp_path / "pt")
    cfg_path = tmp_path / "pt" / "config.json"
    raw = json.loads(cfg_path.read_text())
    raw["architectures"] = ["BertForMaskedLM"]
    cfg_path.write_text(json.dumps(raw))
    mlm = transformers.BertForMaskedLM.from_pretrained(tmp_path / "pt").eval()
    ids, mask = _ragged(rng, 2, 7, mlm.config.vocab_size)
    with torch.no_grad():
        want = mlm(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
        ).logits.numpy()
    ours = blocklab.load_pretrained(tmp_path / "pt")
    _close(ours(jnp.asarray(ids), key_mask=jnp.asarray(mask)), want, mask)

    from safetensors.numpy import load_file, save_file

    (weights,) = (tmp_path / "pt").glob("*.safetensors")
    state = load_file(weights)
    state["cls.extra.weight"] = np.zeros((2, 2), np.float32)
    save_file(state, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="cls.extra.weight"):
        blocklab.load_pretrained(tmp_path / "pt")


def test_a_bf16_bert_folder_loads(tmp_path):
    """A folder stored in BF16 (as most shipped checkpoints are) loads, with
    the logits of the BF16-rounded weights computed in float32."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _bert("BertForMaskedLM", 7)
    ids, mask = _ragged(rng, 2, 6, hf.config.vocab_size)
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    rounded = hf.float().eval()  # the same BF16 values, run in float32
    with torch.no_grad():
        am = torch.tensor(mask.astype(np.int64))
        want = rounded(input_ids=torch.tensor(ids), attention_mask=am).logits.numpy()
    ours = blocklab.load_pretrained(tmp_path / "bf16", dtype=jnp.float32)
    _close(ours(jnp.asarray(ids), key_mask=jnp.asarray(mask)), want, mask)


# ViT ---------------------------------------------------------------------------


def _vit(seed, **fields):
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    rng = np.random.default_rng(seed)
    heads = int(rng.choice([2, 4]))
    p = int(rng.choice([2, 4]))
    cfg = dict(
        hidden_size=heads * int(rng.choice([4, 6])),
        num_hidden_layers=int(rng.integers(1, 4)),
        num_attention_heads=heads,
        intermediate_size=int(rng.integers(8, 40)),
        image_size=p * int(rng.integers(1, 4)),
        patch_size=p,
        num_channels=int(rng.choice([1, 3])),
        qkv_bias=bool(rng.integers(0, 2)),
        num_labels=int(rng.integers(2, 6)),
    )
    cfg.update(fields)
    model = transformers.ViTForImageClassification(transformers.ViTConfig(**cfg))
    return randomize(model, seed=seed, embeddings=1.0), rng


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))]
)
def test_vit_classification_logits(seed):
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _vit(seed)
    c = hf.config
    x = rng.normal(size=(3, c.num_channels, c.image_size, c.image_size))
    x = x.astype(np.float32)
    with torch.no_grad():
        want = hf(pixel_values=torch.tensor(x)).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    _close(ours.classify(images=jnp.asarray(x)), want)


@pytest.mark.slow
def test_vit_folders_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    hf, rng = _vit(4, qkv_bias=False)
    c = hf.config
    x = rng.normal(size=(2, c.num_channels, c.image_size, c.image_size))
    x = x.astype(np.float32)

    def hf_logits(m):
        with torch.no_grad():
            return m(pixel_values=torch.tensor(x)).logits.numpy()

    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    got = ours.classify(images=jnp.asarray(x))
    _close(got, hf_logits(hf))
    blocklab.save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForImageClassification.from_pretrained(
        tmp_path / "ours"
    )
    _close(hf_logits(back.eval()), got)


# ModernBERT --------------------------------------------------------------------


def _modernbert(cls_name, seed, **fields):
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    rng = np.random.default_rng(seed)
    heads = int(rng.choice([2, 4]))
    L = int(rng.integers(2, 5))
    cfg = dict(
        vocab_size=int(rng.integers(20, 60)),
        hidden_size=heads * int(rng.choice([4, 8])),
        intermediate_size=int(rng.integers(6, 30)),
        num_hidden_layers=L,
        num_attention_heads=heads,
        local_attention=int(rng.choice([2, 4, 6])),
        layer_types=[
            "full_attention" if rng.random() < 0.4 else "sliding_attention"
            for _ in range(L)
        ],
        rope_parameters={
            "full_attention": {"rope_type": "default", "rope_theta": 160000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
        },
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        cls_token_id=2,
        sep_token_id=1,
        max_position_embeddings=64,
    )
    cfg.update(fields)
    model = getattr(transformers, cls_name)(transformers.ModernBertConfig(**cfg))
    return randomize(model, seed=seed, embeddings=1.0), rng


@pytest.mark.parametrize(
    "seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in (1, 2, 3))]
)
def test_modernbert_mlm_logits(seed):
    """Random windows, local/global patterns, lengths past the window, padding."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _modernbert("ModernBertForMaskedLM", seed)
    B, T = 3, int(rng.integers(5, 14))
    ids, mask = _ragged(rng, B, T, hf.config.vocab_size)
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
        ).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    got = ours(jnp.asarray(ids), key_mask=jnp.asarray(mask))
    _close(got, want, mask)


@pytest.mark.parametrize(
    "pooling", [pytest.param(p, marks=pytest.mark.slow) for p in ("mean", "cls")]
)
def test_modernbert_sequence_classification(pooling):
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _modernbert(
        "ModernBertForSequenceClassification", 5, num_labels=3,
        classifier_pooling=pooling,
    )  # fmt: skip
    ids, mask = _ragged(rng, 3, 9, hf.config.vocab_size)
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(ids),
            attention_mask=torch.tensor(mask.astype(np.int64)),
        ).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    _close(ours.classify(jnp.asarray(ids), key_mask=jnp.asarray(mask)), want)


@pytest.mark.slow
def test_modernbert_folders_both_ways(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    hf, rng = _modernbert("ModernBertForMaskedLM", 6)
    ids, mask = _ragged(rng, 2, 11, hf.config.vocab_size)

    def hf_logits(m):
        with torch.no_grad():
            return m(
                input_ids=torch.tensor(ids),
                attention_mask=torch.tensor(mask.astype(np.int64)),
            ).logits.numpy()

    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    got = ours(jnp.asarray(ids), key_mask=jnp.asarray(mask))
    _close(got, hf_logits(hf), mask)
    blocklab.save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForMaskedLM.from_pretrained(tmp_path / "ours")
    _close(hf_logits(back.eval()), got, mask)


# Refusals ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,fields,name",
    [
        (
            "bert",
            dict(position_embedding_type="relative_key"),
            "position_embedding_type",
        ),
        ("bert", dict(is_decoder=True), "is_decoder"),
        ("bert", dict(hidden_act="silu"), "hidden_act"),
        ("bert", dict(brand_new_switch=True), "brand_new_switch"),
        ("modernbert", dict(norm_bias=True), "norm_bias"),
        ("modernbert", dict(hidden_activation="tanh"), "hidden_activation"),
        ("modernbert", dict(local_attention=5), "local_attention"),
        ("vit", dict(image_size=[8, 12]), "image_size"),
    ],
)
def test_unimplemented_config_fields_refused_by_name(family, fields, name):
    transformers = pytest.importorskip("transformers")
    from blocklab.interop import FAMILIES as ENCODER_FAMILIES

    small = {
        "bert": (transformers.BertConfig, dict(hidden_size=8, num_attention_heads=2)),
        "modernbert": (
            transformers.ModernBertConfig,
            dict(hidden_size=8, num_attention_heads=2, num_hidden_layers=2),
        ),
        "vit": (transformers.ViTConfig, dict(hidden_size=8, num_attention_heads=2)),
    }
    config_cls, base = small[family]
    fam = ENCODER_FAMILIES[family]
    fam.to_config(config_cls(**base), fam.classes[0])  # the base converts
    with pytest.raises(ConfigError, match=name):
        fam.to_config(config_cls(**base, **fields), fam.classes[0])


def test_modernbert_legacy_config_json_reads_as_transformers():
    """The original checkpoints' config.json (global_attn_every_n_layers,
    global/local_rope_theta, unused legacy keys): the layer pattern, bases
    and window transformers derives from it."""
    import types

    transformers = pytest.importorskip("transformers")
    from blocklab.interop.families.modernbert import modernbert_config

    raw = dict(
        architectures=["ModernBertForMaskedLM"], model_type="modernbert",
        vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=7,
        num_attention_heads=2, global_attn_every_n_layers=3, global_rope_theta=1000.0,
        local_rope_theta=50.0, local_attention=6, layer_norm_eps=1e-5,
        position_embedding_type="absolute", reference_compile=True,
        gradient_checkpointing=False, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        cls_token_id=2, sep_token_id=1,
    )  # fmt: skip
    cfg = modernbert_config(types.SimpleNamespace(**raw), "ModernBertForMaskedLM")
    hf = transformers.ModernBertConfig(**raw)
    full = [i for i, t in enumerate(hf.layer_types) if t == "full_attention"]
    assert list(cfg.global_layers) == full == [0, 3, 6]
    assert cfg.block.window - 1 == hf.sliding_window == 3
    thetas = cfg.layer_thetas()
    for i, t in enumerate(hf.layer_types):
        assert thetas[i] == hf.rope_parameters[t]["rope_theta"]


def test_state_dicts_round_trip_and_constants_are_checked():
    """to_huggingface_state_dict / load_huggingface_state_dict invert each
    other for an encoder model; a parameter transformers lacks (ModernBERT's
    LayerNorm bias) must hold its constant to export."""
    transformers = pytest.importorskip("transformers")
    from blocklab.interop import load_huggingface_state_dict, to_huggingface_state_dict
    from blocklab.interop.families.modernbert import modernbert_config
    from blocklab.models.encoder import EncoderModel

    hf = transformers.ModernBertConfig(
        vocab_size=30, hidden_size=8, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=2, local_attention=4, pad_token_id=0, eos_token_id=1,
        bos_token_id=2, cls_token_id=2, sep_token_id=1,
    )  # fmt: skip
    cfg = modernbert_config(hf, "ModernBertForMaskedLM")
    model = EncoderModel(cfg, key=jax.random.key(0))
    sd = to_huggingface_state_dict(model)
    assert "decoder.weight" not in sd and "model.layers.0.attn_norm.weight" not in sd
    back = load_huggingface_state_dict(cfg, sd)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    biased = eqx.tree_at(lambda m: m.emb_norm.bias, model, model.emb_norm.bias + 0.5)
    with pytest.raises(ConfigError, match="emb_norm.bias"):
        to_huggingface_state_dict(biased)
