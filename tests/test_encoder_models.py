"""The encoder and encoder–decoder models: bidirectional context, padding,
the MLM and classification heads against NumPy, cached cross-attention equal
to recomputation, greedy decoding against an uncached argmax loop, the
losses against NumPy, and bad input refused by name."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.models.encoder import EncoderModel
from blocklab.models.encoder_config import EncoderConfig, EncoderDecoderConfig
from blocklab.models.encoder_decoder import EncoderDecoderLM
from blocklab.training import losses


def _bert(**kw):
    fields = dict(
        norm="layer", norm_eps=1e-12, act="gelu_exact", placement="post",
        bias=True, type_vocab_size=2, embed_norm=True, final_norm=False,
        mlm_head=True, num_labels=3, pooler="tanh", max_len=16,
    )  # fmt: skip
    return EncoderModel(
        EncoderConfig(50, 16, 4, 2, **{**fields, **kw}), key=jax.random.key(0)
    )


def _t5(**kw):
    fields = dict(
        num_decoder_blks=3, attn_scale=1.0, act="geglu", relative_num_buckets=8,
        relative_max_distance=20, head_scale=16**-0.5, eos_token_id=1,
    )  # fmt: skip
    return EncoderDecoderLM(
        EncoderDecoderConfig(40, 16, 4, 2, **{**fields, **kw}), key=jax.random.key(0)
    )


IDS = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
MASK = IDS > 0


def _perturbed(model):
    """Weights scaled up so that the outputs depend visibly on the context."""
    return jax.tree_util.tree_map(
        lambda a: a * 3 if eqx.is_inexact_array(a) and a.ndim == 2 else a, model
    )


@pytest.mark.slow
def test_encoder_is_bidirectional_and_ignores_padding():
    m = _perturbed(_bert())
    h = m.hidden(IDS, key_mask=MASK)
    later = IDS.copy()
    later[1, 5] = 20  # a change at the last position reaches the first token
    assert not np.allclose(m.hidden(later, key_mask=MASK)[1, 0], h[1, 0], atol=1e-4)
    padded = IDS.copy()
    padded[0, 4:] = 33  # what sits in the padding changes nothing real
    np.testing.assert_allclose(
        m.hidden(padded, key_mask=MASK)[0, :4], h[0, :4], atol=1e-5
    )
    np.testing.assert_allclose(m.hidden(IDS, valid_lens=np.array([4, 6])), h, atol=1e-6)


@pytest.mark.slow
def test_mlm_and_classification_heads_equal_numpy():
    m = _bert(num_labels=2, pooler="transform", pooling="mean", head_bias=False)
    m = eqx.tree_at(lambda m: m.mlm_bias, m, jnp.arange(50.0) / 50)
    h = np.asarray(m.hidden(IDS, key_mask=MASK), np.float64)

    def gelu(z):
        from math import erf

        return np.vectorize(lambda t: 0.5 * t * (1 + erf(t / np.sqrt(2))))(z)

    def layer_norm(z, norm):
        mu = z.mean(-1, keepdims=True)
        var = ((z - mu) ** 2).mean(-1, keepdims=True)
        w, b = np.asarray(norm.weight), np.asarray(norm.bias)
        return (z - mu) / np.sqrt(var + norm.eps) * w + b

    t = layer_norm(gelu(h @ np.asarray(m.mlm_dense.weight).T), m.mlm_norm)
    want = t @ np.asarray(m.token_emb.weight).T + np.arange(50.0) / 50
    np.testing.assert_allclose(m(IDS, key_mask=MASK), want, atol=2e-5, rtol=1e-5)
    pooled = (h * MASK[..., None]).sum(1) / MASK.sum(1, keepdims=True)
    p = layer_norm(gelu(pooled @ np.asarray(m.pooler_dense.weight).T), m.pooler_norm)
    want = p @ np.asarray(m.classifier.weight).T + np.asarray(m.classifier.bias)
    np.testing.assert_allclose(m.classify(IDS, key_mask=MASK), want, atol=2e-5)


@pytest.mark.slow  # CI time: the default suite keeps the cheaper checks of this feature
def test_cached_cross_attention_equals_recomputation_on_ragged_sources():
    m = _perturbed(_t5())
    tgt = np.array([[0, 11, 12, 13, 14], [0, 21, 22, 23, 24]])
    full = m(IDS, tgt, src_mask=MASK)
    enc = m.encode(IDS, src_mask=MASK)
    cache = m.init_cache(enc, src_mask=MASK, max_len=8)
    # the cross keys and values are computed once, here, for every layer
    assert cache.cross.k.shape == (3, 2, 4, 4, 6)
    step = eqx.filter_jit(lambda m, t, c: m.decode_step(t, c))
    out, cache = step(m, tgt[:, :2], cache)
    outs = [out]
    for t in range(2, 5):
        out, cache = step(m, tgt[:, t : t + 1], cache)
        outs.append(out)
    scale = float(jnp.max(jnp.abs(full)))
    np.testing.assert_allclose(
        jnp.concatenate(outs, axis=1), full, atol=1e-5 * scale, rtol=1e-5
    )
    # padding in the source changes nothing
    padded = IDS.copy()
    padded[0, 4:] = 7
    np.testing.assert_allclose(m(padded, tgt, src_mask=MASK), full, atol=1e-5 * scale)


@pytest.mark.slow
def test_greedy_equals_an_uncached_argmax_loop():
    m = _perturbed(_t5(eos_token_id=None))
    n = 6
    got = np.asarray(m.greedy(IDS, n, src_mask=MASK))
    tgt = np.zeros((2, 1), np.int64)  # decoder_start_token_id 0
    for _ in range(n):
        nxt = np.argmax(np.asarray(m(IDS, tgt, src_mask=MASK))[:, -1], -1)
        tgt = np.concatenate([tgt, nxt[:, None]], axis=1)
    np.testing.assert_array_equal(got, tgt[:, 1:])


@pytest.mark.slow
def test_losses_equal_numpy_cross_entropy():
    m = _bert()
    ids, labels = losses.mask_tokens(
        jax.random.key(3), IDS, mask_id=3, vocab_size=50, rate=0.5
    )
    labels = np.asarray(labels)
    assert (labels >= 0).any() and (labels == -100).any()
    logits = np.asarray(m(ids, key_mask=MASK), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    sel = labels >= 0
    want = -np.mean(logp[sel, labels[sel]])
    np.testing.assert_allclose(
        losses.mlm_loss(m, ids, labels, key_mask=MASK), want, rtol=1e-5
    )
    ed = _t5()
    tgt_in, tgt_out = IDS[:, :4], np.where(IDS[:, 1:5] > 0, IDS[:, 1:5], -100)
    logits = np.asarray(ed(IDS, tgt_in, src_mask=MASK), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    sel = tgt_out >= 0
    want = -np.mean(logp[sel, tgt_out[sel]])
    got = losses.seq2seq_loss(ed, IDS, tgt_in, tgt_out, src_mask=MASK)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_bad_input_is_refused_by_name():
    ed = _t5()
    enc = ed.encode(IDS, src_mask=MASK)
    with pytest.raises(ConfigError, match="needs the encoder states"):
        ed.decode(IDS[:, :3], None)
    with pytest.raises(ConfigError, match="num_hiddens=16"):
        ed.decode(IDS[:, :3], enc[..., :8])
    with pytest.raises(ConfigError, match="key_mask"):
        ed.decode(IDS[:, :3], enc, src_mask=MASK[:, :5])
    with pytest.raises(ConfigError, match="tgt_ids"):
        ed(IDS)
    with pytest.raises(ConfigError, match="key_mask"):
        _bert().hidden(IDS, key_mask=MASK[:1, :4])
    with pytest.raises(ConfigError, match="type_vocab_size"):
        EncoderModel(EncoderConfig(50, 16, 4, 1), key=jax.random.key(0)).hidden(
            IDS, token_type_ids=np.zeros_like(IDS)
        )
    with pytest.raises(ConfigError, match="window"):
        EncoderDecoderConfig(40, 16, 4, 2, window=4)
    with pytest.raises(ConfigError, match="skip_attn_norm"):
        EncoderConfig(50, 16, 4, 2, placement="post", first_attn_norm=False)


@pytest.mark.slow
def test_modernbert_style_encoder_runs_its_layer_data():
    cfg = EncoderConfig(
        60, 16, 4, 4, norm="layer", act="geglu_exact", positions="rope",
        rope_theta=160000.0, local_rope_theta=1e4, window=3,
        window_mode="bidirectional", global_layers=(0, 3), embed_norm=True,
        first_attn_norm=False, mlm_head=True, head_bias=False,
    )  # fmt: skip
    m = EncoderModel(cfg, key=jax.random.key(0))
    np.testing.assert_array_equal(m.stack.blocks.skip_norm1, [1, 0, 0, 0])
    np.testing.assert_array_equal(m.stack.blocks.attention.window, [0, 3, 3, 0])
    # layer 0 reads the stream unnormed: its norm1 gain does not matter
    m2 = eqx.tree_at(
        lambda m: m.stack.blocks.norm1.weight,
        m,
        m.stack.blocks.norm1.weight.at[0].mul(5.0),
    )
    np.testing.assert_allclose(m2(IDS), m(IDS), atol=1e-6)
    m3 = eqx.tree_at(
        lambda m: m.stack.blocks.norm1.weight,
        m,
        m.stack.blocks.norm1.weight.at[1].mul(5.0),
    )
    assert not np.allclose(m3(IDS), m(IDS), atol=1e-4)
