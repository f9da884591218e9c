"""`model(...)` of a model with a head returns that head's output, as the
`transformers` class of the same name does: classification logits for
`ViTForImageClassification` and `BertForSequenceClassification`, MLM logits
for `BertForMaskedLM`, the last hidden state for a head-less `BertModel`;
`hidden(...)` is always the states (issue 43, item 8)."""

import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import blocklab  # noqa: E402


def _close(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.abs(got - want).max() <= 1e-5 * scale


def _bert_config(**kw):
    return transformers.BertConfig(
        vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, max_position_embeddings=16, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0, **kw,
    )  # fmt: skip


IDS = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
MASK = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)


def _hf(model):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():  # away from the init's zeros and ones
            p.add_(0.1 * torch.randn_like(p))
        return model.eval()


def test_vit_classifier_call_returns_the_class_logits():
    config = transformers.ViTConfig(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=24, image_size=8, patch_size=4, num_channels=3,
        num_labels=5, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    hf = _hf(transformers.ViTForImageClassification(config))
    x = np.random.default_rng(0).normal(size=(2, 3, 8, 8)).astype(np.float32)
    with torch.no_grad():
        want = hf(pixel_values=torch.tensor(x)).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    got = ours(images=jnp.asarray(x))
    assert got.shape == (2, 5)  # not the (2, 5, 16) states of 0.3
    _close(got, want)
    assert ours.hidden(images=jnp.asarray(x)).shape == (2, 5, 16)  # 4 patches + cls


def test_bert_classifier_masked_lm_and_base_calls():
    seq = _hf(transformers.BertForSequenceClassification(_bert_config(num_labels=3)))
    mlm = _hf(transformers.BertForMaskedLM(_bert_config()))
    base = _hf(transformers.BertModel(_bert_config(), add_pooling_layer=False))
    ids, mask = torch.tensor(IDS), torch.tensor(MASK.astype(np.int64))
    with torch.no_grad():
        want = {
            "seq": seq(input_ids=ids, attention_mask=mask).logits.numpy(),
            "mlm": mlm(input_ids=ids, attention_mask=mask).logits.numpy(),
            "base": base(input_ids=ids, attention_mask=mask).last_hidden_state.numpy(),
        }
    for name, hf in (("seq", seq), ("mlm", mlm), ("base", base)):
        ours = blocklab.from_huggingface(hf)
        got = ours(jnp.asarray(IDS), key_mask=jnp.asarray(MASK))
        if name == "base":  # padded rows are the caller's to ignore
            got, want[name] = np.asarray(got)[MASK], want[name][MASK]
        _close(got, want[name])
