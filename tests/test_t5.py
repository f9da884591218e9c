"""T5: relative position buckets and bias, the family's conversion, generation.

The buckets are checked against a NumPy port of the formula (written here from
T5's definition, float32 as Mesh TensorFlow computes it), the worked table of
the reference notes, and `transformers`' `T5Attention._relative_position_bucket`.
"""

from __future__ import annotations

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.nn.mask import Mask
from blocklab.nn.relative_position import (
    RelativePositionBias,
    bucket_table,
    relative_position_bucket,
)


def _np_bucket(rel, bidirectional, num_buckets, max_distance):
    """T5's bucket of each relative position (key - query), one at a time."""
    out = []
    for r in np.ravel(rel):
        n = num_buckets
        b = 0
        if bidirectional:
            n //= 2
            b = n if r > 0 else 0
            d = abs(int(r))
        else:
            d = max(-int(r), 0)
        m = n // 2
        if d < m:
            b += d
        else:
            x = np.float32(np.log(np.float32(d) / np.float32(m)))
            x = np.float32(x / np.float32(math.log(max_distance / m)))
            x = np.float32(x * np.float32(n - m))
            b += min(m + int(x), n - 1)  # int(): truncation toward zero
        out.append(b)
    return np.array(out).reshape(np.shape(rel))


def test_worked_table():
    """The table of the reference notes (nb=8, max_distance=20), by hand."""
    rel = np.arange(-25, 26)
    bi = np.asarray(relative_position_bucket(rel, num_buckets=8, max_distance=20))
    want = {r: 3 for r in range(-25, -6)}
    want.update({r: 2 for r in range(-6, -1)})
    want.update({-1: 1, 0: 0, 1: 5})
    want.update({r: 6 for r in range(2, 7)})
    want.update({r: 7 for r in range(7, 26)})
    assert bi.tolist() == [want[r] for r in rel]
    causal = np.asarray(
        relative_position_bucket(
            rel, bidirectional=False, num_buckets=8, max_distance=20
        )
    )
    want = {0: 0, -1: 1, -2: 2, -3: 3, -4: 4, -5: 4}
    want.update({r: 5 for r in range(-8, -5)})
    want.update({r: 6 for r in range(-13, -8)})
    want.update({r: 7 for r in range(-25, -13)})
    want.update({r: 0 for r in range(1, 26)})
    assert causal.tolist() == [want[r] for r in rel]


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize(
    "num_buckets,max_distance", [(32, 128), (16, 128), (8, 20), (6, 7), (40, 300)]
)
def test_buckets_match_numpy_port(bidirectional, num_buckets, max_distance):
    rel = np.arange(-3 * max_distance, 3 * max_distance + 1)
    got = jax.jit(
        lambda r: relative_position_bucket(
            r,
            bidirectional=bidirectional,
            num_buckets=num_buckets,
            max_distance=max_distance,
        )
    )(rel)
    want = _np_bucket(rel, bidirectional, num_buckets, max_distance)
    np.testing.assert_array_equal(np.asarray(got), want)


_SWEEP = [(nb, M) for nb in (4, 6, 10, 33, 64) for M in (5, 8, 20, 64, 200)]


@pytest.mark.parametrize(
    "sweep",
    [
        [(32, 128), (16, 128), (8, 20)],
        pytest.param(_SWEEP, marks=pytest.mark.slow),
    ],
    ids=["t5", "sweep"],
)
def test_buckets_match_transformers(sweep):
    """Both directions, over offsets past the maximum distance, including the
    float32 boundaries (n = 16, M = 128: d = 16, 32, 64 are exact powers of
    the log base)."""
    torch = pytest.importorskip("torch")
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    bucket = t5.T5Attention._relative_position_bucket
    for nb, M in sweep:
        for bi in (True, False):
            n = nb // 2 if bi else nb
            if M <= n // 2:
                continue
            rel = np.arange(-2 * M - 3, 2 * M + 4)
            want = bucket(
                torch.tensor(rel), bidirectional=bi, num_buckets=nb, max_distance=M
            ).numpy()
            got = relative_position_bucket(
                rel, bidirectional=bi, num_buckets=nb, max_distance=M
            )
            np.testing.assert_array_equal(
                np.asarray(got), want, err_msg=f"nb={nb} M={M} bi={bi}"
            )


def test_bucket_table_ends_in_last_bucket():
    t = bucket_table(32, 128)
    assert t.shape == (129,) and t[-1] == 15 and t[:8].tolist() == list(range(8))
    assert np.all(np.diff(t) >= 0)


@pytest.mark.parametrize(
    "kwargs,name",
    [
        (dict(num_buckets=2, max_distance=10), "num_buckets"),
        (dict(num_buckets=32, max_distance=8), "max_distance"),
        (dict(num_buckets=0, max_distance=8), "num_buckets"),
    ],
)
def test_degenerate_buckets_refused(kwargs, name):
    with pytest.raises(ConfigError, match=name):
        relative_position_bucket(np.arange(3), **kwargs)


def test_bias_gathers_table_per_head():
    """B[h, i, j] = W[bucket(j - (offset + i)), h], by a Python loop."""
    bias = RelativePositionBias(
        3, num_buckets=8, max_distance=20, bidirectional=False, key=jax.random.key(0)
    )
    W = np.asarray(bias.weight)
    out = np.asarray(bias(4, 9, offset=5))
    assert out.shape == (3, 4, 9)
    for i in range(4):
        for j in range(9):
            b = _np_bucket(np.array([j - (5 + i)]), False, 8, 20)[0]
            np.testing.assert_array_equal(out[:, i, j], W[b])
    # per-sequence offsets (traced): a batch of biases
    many = jax.jit(lambda o: bias(1, 9, offset=o))(jnp.array([5, 6, 7, 8]))
    np.testing.assert_array_equal(np.asarray(many)[:, :, 0], out.transpose(1, 0, 2))


def test_bias_matches_transformers_compute_bias():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.models.t5.modeling_t5 import T5Attention

    cfg = transformers.T5Config(
        d_model=16, d_kv=4, num_heads=4, relative_attention_num_buckets=12,
        relative_attention_max_distance=30,
    )  # fmt: skip
    for is_decoder in (False, True):
        cfg.is_decoder = is_decoder
        att = T5Attention(cfg, has_relative_attention_bias=True)
        with torch.no_grad():
            att.relative_attention_bias.weight.normal_()
        want = att.compute_bias(7, 40, past_seen_tokens=33).detach().numpy()[0]
        ours = RelativePositionBias(
            4, num_buckets=12, max_distance=30, bidirectional=not is_decoder,
            key=jax.random.key(1),
        )  # fmt: skip
        table = jnp.asarray(att.relative_attention_bias.weight.detach().numpy())
        ours = eqx.tree_at(lambda b: b.weight, ours, table)
        got = np.asarray(ours(7, 40, offset=33))
        np.testing.assert_array_equal(got, want)


# The family against transformers ---------------------------------------------------


def _close(got, want, where=None):
    """|got - want| <= 1e-5 x the scale of want (rows `where` only)."""
    got, want = np.asarray(got), np.asarray(want)
    if where is not None:
        got, want = got[where], want[where]
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * scale, f"max |diff| {err:.3g} > 1e-5 x scale {scale:.3g}"


_FAMILIES = {
    "t5": ("T5Config", "T5ForConditionalGeneration"),
    "umt5": ("UMT5Config", "UMT5ForConditionalGeneration"),
    "mt5": ("MT5Config", "MT5ForConditionalGeneration"),
}


def _t5(seed, family="t5", **fields):
    """A random tiny T5ForConditionalGeneration (or umT5's, mT5's): widths,
    heads, d_kv (not d_model / heads), depths, buckets drawn from `seed`;
    random weights."""
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    rng = np.random.default_rng(seed)
    cfg = dict(
        vocab_size=int(rng.integers(20, 64)),
        d_model=int(rng.choice([8, 12, 16])),
        d_kv=int(rng.choice([3, 4, 8])),
        d_ff=int(rng.integers(6, 40)),
        num_layers=int(rng.integers(1, 4)),
        num_decoder_layers=int(rng.integers(1, 4)),
        num_heads=int(rng.choice([1, 2, 4])),
        relative_attention_num_buckets=int(rng.choice([8, 12, 32])),
        relative_attention_max_distance=int(rng.choice([17, 40, 128])),
        feed_forward_proj=str(rng.choice(["gated-gelu", "relu"])),
        tie_word_embeddings=bool(rng.integers(0, 2)),
        decoder_start_token_id=0,
        eos_token_id=1,
        pad_token_id=0,
        dropout_rate=0.1,
    )
    cfg.update(fields)
    config_cls, model_cls = _FAMILIES[family]
    config = getattr(transformers, config_cls)(**cfg)
    model = getattr(transformers, model_cls)(config)
    model = randomize(model, seed=seed, matrices=0.3, embeddings=1.0)
    if not cfg["tie_word_embeddings"] and rng.integers(0, 2):
        import torch

        # v1.1's layout: an lm_head of its own
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
        with torch.no_grad():
            model.lm_head.weight.normal_(generator=torch.Generator().manual_seed(seed))
    return model, rng


def _ragged(rng, B, T, vocab, lo=1):
    ids = rng.integers(2, vocab, size=(B, T))
    lens = rng.integers(lo, T + 1, size=B)
    lens[0] = T
    return ids, np.arange(T)[None, :] < lens[:, None]


def _cases(default, slow):
    """`(family, seed)` parameters: `default` in the default run, `slow` slow."""
    return [
        *(pytest.param(f, s, id=f"{f}-{s}") for f, s in default),
        *(pytest.param(f, s, id=f"{f}-{s}", marks=pytest.mark.slow) for f, s in slow),
    ]


@pytest.mark.parametrize(
    "family,seed",
    _cases(
        [("t5", 1), ("umt5", 2)],
        [*(("t5", s) for s in (0, *range(2, 8))), *(("umt5", s) for s in range(3, 9))],
    ),
)
def test_t5_logits(family, seed):
    """Encoder states and logits of T5 and umT5 (a bias table per layer)
    against transformers, on a ragged batch."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _t5(seed, family)
    c = hf.config
    B, S, T = 3, int(rng.integers(1, 12)), int(rng.integers(1, 9))
    src, mask = _ragged(rng, B, S, c.vocab_size)
    tgt = rng.integers(0, c.vocab_size, size=(B, T))
    with torch.no_grad():
        out = hf(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            decoder_input_ids=torch.tensor(tgt),
        )
    ours = blocklab.from_huggingface(hf)
    untied = hf.lm_head.weight.data_ptr() != hf.shared.weight.data_ptr()
    assert ours.cfg.tie_embeddings is not untied
    per_layer = {"t5": "shared", "umt5": "per_layer"}[family]
    assert ours.cfg.relative_bias == per_layer
    enc = ours.encode(jnp.asarray(src), src_mask=jnp.asarray(mask))
    _close(enc, out.encoder_last_hidden_state.numpy(), mask)
    got = ours(jnp.asarray(src), jnp.asarray(tgt), src_mask=jnp.asarray(mask))
    _close(got, out.logits.numpy())


@pytest.mark.parametrize(
    "family,seed",
    _cases(
        [("t5", 10), ("umt5", 14)],
        [("t5", 11), ("t5", 12), ("t5", 13), ("umt5", 15), ("umt5", 16)],
    ),
)
def test_t5_greedy_equals_generate(family, seed):
    """20 greedy tokens on a ragged batch, token for token (after eos: pad).

    The decoder is not deeper than the encoder: transformers 5.24's generate
    sizes its cache by the encoder's depth (IndexError otherwise)."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _t5(seed, family, num_decoder_layers=None)
    c = hf.config
    S = int(rng.integers(3, 12))
    src, mask = _ragged(rng, 4, S, c.vocab_size)
    with torch.no_grad():
        want = hf.generate(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            max_new_tokens=20,
            do_sample=False,
            num_beams=1,
        ).numpy()[:, 1:]  # without the decoder start token
    want = np.pad(want, ((0, 0), (0, 20 - want.shape[1])), constant_values=0)
    ours = blocklab.from_huggingface(hf)
    got = np.asarray(ours.greedy(jnp.asarray(src), 20, src_mask=jnp.asarray(mask)))
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize(
    "family,tied",
    [
        ("t5", False),
        ("umt5", True),
        pytest.param("t5", True, marks=pytest.mark.slow),
        pytest.param("umt5", False, marks=pytest.mark.slow),
    ],
)
def test_t5_folders_both_ways(tmp_path, family, tied):
    """transformers' save_pretrained -> load_pretrained (no torch on that
    path), and save_pretrained -> transformers' from_pretrained: equal logits
    both ways; v1.1's layout (an untied head, no output rescale) and v1.0's
    (tied, rescaled by d**-0.5)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    proj = "relu" if tied else "gated-gelu"
    hf, rng = _t5(4, family, tie_word_embeddings=tied, feed_forward_proj=proj)
    if not tied:
        with torch.no_grad():  # v1.1: an lm_head of its own
            w = torch.randn(hf.lm_head.weight.shape)
            hf.lm_head.weight = torch.nn.Parameter(w)
    src, mask = _ragged(rng, 2, 7, hf.config.vocab_size)
    tgt = rng.integers(0, hf.config.vocab_size, size=(2, 5))

    def hf_logits(m):
        with torch.no_grad():
            return m(
                input_ids=torch.tensor(src),
                attention_mask=torch.tensor(mask.astype(np.int64)),
                decoder_input_ids=torch.tensor(tgt),
            ).logits.numpy()

    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    assert ours.cfg.tie_embeddings is tied
    assert (ours.cfg.head_scale is None) is not tied
    got = ours(jnp.asarray(src), jnp.asarray(tgt), src_mask=jnp.asarray(mask))
    _close(got, hf_logits(hf))
    blocklab.save_pretrained(ours, tmp_path / "ours")
    back = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ours")
    assert type(back) is type(hf)
    _close(hf_logits(back.eval()), got)
    again = blocklab.load_pretrained(tmp_path / "ours")
    np.testing.assert_array_equal(
        np.asarray(again.head_weight), np.asarray(ours.head_weight)
    )


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(feed_forward_proj="gelu_fast"), "feed_forward_proj"),
        (dict(feed_forward_proj="gated-tanh"), "feed_forward_proj"),
        (dict(some_new_option=3), "some_new_option"),
    ],
)
def test_t5_unimplemented_fields_refused_by_name(fields, name):
    """An activation blocklab lacks, or a field it does not know, is refused
    naming the field; T5 v1.0's relu and v1.1's gated-gelu are implemented."""
    transformers = pytest.importorskip("transformers")
    from blocklab.interop.families.t5 import t5_config

    base = dict(vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2)
    for ok in ("relu", "gated-gelu"):
        cfg = t5_config(transformers.T5Config(**base, feed_forward_proj=ok))
        assert cfg.block.act == {"relu": "relu", "gated-gelu": "geglu"}[ok]
    with pytest.raises(ConfigError, match=name):
        t5_config(transformers.T5Config(**base, **fields))


def test_mt5_is_t5_v1_1_without_the_output_rescale(tmp_path):
    """MT5ForConditionalGeneration is T5's mathematics, but never rescales the
    decoder output, whatever tie_word_embeddings says: transformers' logits,
    from the model and from its folder (mT5's defaults fill what the
    config.json leaves out)."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _t5(5, "mt5", tie_word_embeddings=True, num_heads=6, d_ff=1024)
    src, mask = _ragged(rng, 2, 6, hf.config.vocab_size)
    tgt = rng.integers(0, hf.config.vocab_size, size=(2, 4))
    with torch.no_grad():
        want = hf(
            input_ids=torch.tensor(src),
            attention_mask=torch.tensor(mask.astype(np.int64)),
            decoder_input_ids=torch.tensor(tgt),
        ).logits.numpy()
    ours = blocklab.from_huggingface(hf)
    assert ours.cfg.head_scale is None and ours.cfg.relative_bias == "shared"
    _close(ours(src, tgt, src_mask=mask), want)
    hf.save_pretrained(tmp_path)
    folder = blocklab.load_pretrained(tmp_path)
    assert folder.cfg.num_heads == 6 and folder.cfg.block.ffn_width == 1024
    _close(folder(src, tgt, src_mask=mask), want)


def test_t5_family_classes_refused_by_name():
    """A class of the family blocklab does not convert is named."""
    pytest.importorskip("transformers")
    from blocklab.interop.families.t5 import t5_config

    with pytest.raises(ConfigError, match="T5ForQuestionAnswering"):
        t5_config(object(), "T5ForQuestionAnswering")


def test_t5_training_mode_refused():
    pytest.importorskip("torch")
    import blocklab

    hf, _ = _t5(0)
    with pytest.raises(ConfigError, match="dropout_rate"):
        blocklab.from_huggingface(hf.train())


# umT5's per-layer tables in the model ----------------------------------------------


def _umt5(**kw):
    from blocklab.models.encoder_config import EncoderDecoderConfig
    from blocklab.models.encoder_decoder import EncoderDecoderLM

    fields = dict(
        num_decoder_blks=3, attn_scale=1.0, act="geglu", relative_num_buckets=8,
        relative_max_distance=20, relative_bias="per_layer", eos_token_id=1,
    )  # fmt: skip
    m = EncoderDecoderLM(
        EncoderDecoderConfig(40, 16, 4, 2, **{**fields, **kw}), key=jax.random.key(0)
    )
    # tables large enough that a wrong layer's bias shows in the outputs
    return eqx.tree_at(
        lambda m: (m.enc_rel_bias.blocks.weight, m.dec_rel_bias.blocks.weight),
        m,
        (m.enc_rel_bias.blocks.weight * 30, m.dec_rel_bias.blocks.weight * 30),
    )


_SRC = np.array([[5, 6, 7, 8, 0, 0], [9, 10, 11, 12, 13, 14]])
_TGT = np.array([[0, 11, 12, 13], [0, 21, 22, 23]])


def test_per_layer_tables_are_stacked_and_each_stack_is_one_scan():
    """The tables are `(N, buckets, H)`; encode, decode and a cached decode
    step are one scan each (the tables scanned with the blocks). Traced on
    the abstract model: nothing is built or compiled."""
    from blocklab.models.encoder_config import EncoderDecoderConfig
    from blocklab.models.encoder_decoder import EncoderDecoderLM

    cfg = EncoderDecoderConfig(
        40, 16, 4, 2, num_decoder_blks=3, relative_num_buckets=8,
        relative_max_distance=20, relative_bias="per_layer",
    )  # fmt: skip
    m = eqx.filter_eval_shape(EncoderDecoderLM, cfg, key=jax.random.key(0))
    assert m.enc_rel_bias.blocks.weight.shape == (2, 8, 4)
    assert m.dec_rel_bias.blocks.weight.shape == (3, 8, 4)
    mask = _SRC > 0
    enc = jnp.zeros((2, 6, 16))
    for fn in (
        lambda m: m.encode(_SRC, src_mask=mask),
        lambda m: m.decode(_TGT, enc, src_mask=mask),
        lambda m: m.decode_step(_TGT[:, :1], m.init_cache(enc, src_mask=mask)),
    ):
        assert str(jax.make_jaxpr(fn)(m)).count("scan[") == 1


@pytest.mark.slow
def test_per_layer_tables_equal_a_loop_over_the_layers():
    """Encoder states and logits equal a loop over the layers in which layer
    i adds the bias of its own table i."""
    m = _umt5()
    mask = _SRC > 0

    @jax.jit
    def both(m):
        enc = m.encode(_SRC, src_mask=mask)
        return enc, m.decode(_TGT, enc, src_mask=mask)

    @jax.jit
    def loop(m):
        h = m.token_emb.weight[_SRC]
        for i in range(2):
            bias = m.enc_rel_bias.block(i)(6, 6)
            h = m.encoder.block(i)(h, Mask.padding(mask), score_bias=bias)
        enc = m.enc_norm(h)
        y = m.token_emb.weight[_TGT]
        for i in range(3):
            bias = m.dec_rel_bias.block(i)(4, 4)
            y = m.decoder.block(i)(
                y,
                jnp.arange(1, 5),
                context=enc,
                cross_mask=Mask.padding(mask),
                score_bias=bias,
            )
        return enc, m.logits(m.dec_norm(y))

    for got, want in zip(both(m), loop(m), strict=True):
        _close(got, want)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots", "nested"])
def test_per_layer_tables_under_hooks_remat_and_cache(remat):
    """Hooks see every layer and change nothing; a remat policy gives the
    same loss and table gradients; cached decoding equals teacher forcing."""
    from blocklab.nn.hooks import Hooks
    from blocklab.nn.remat import with_remat
    from blocklab.training.losses import seq2seq_loss

    m = _umt5()
    mask = _SRC > 0
    tgt_out = np.where(_TGT > 0, _TGT, 3)

    def loss(m):
        return seq2seq_loss(m, _SRC, _TGT, tgt_out, src_mask=mask)

    grad = eqx.filter_jit(eqx.filter_value_and_grad(loss))
    (l0, g0), (l1, g1) = grad(m), grad(with_remat(m, remat))
    np.testing.assert_allclose(l1, l0, rtol=1e-6)
    for a, b in (
        (g1.enc_rel_bias, g0.enc_rel_bias),
        (g1.dec_rel_bias, g0.dec_rel_bias),
    ):
        a, b = a.blocks.weight, b.blocks.weight
        np.testing.assert_allclose(a, b, atol=1e-5 * float(jnp.abs(b).max()))
        assert np.all(np.abs(b).reshape(len(b), -1).max(-1) > 0)  # every table learns
    if remat != "full":
        return
    hooks = Hooks(record=["blocks.*.attn.hook_attn_scores"])
    enc = m.encode(_SRC, src_mask=mask)
    full = m.decode(_TGT, enc, src_mask=mask, hooks=hooks)
    _close(full, m.decode(_TGT, enc, src_mask=mask))
    scores = hooks.values["blocks.*.attn.hook_attn_scores"]
    assert scores.shape == (3, 2, 4, 4, 4)
    cache = m.init_cache(enc, src_mask=mask, max_len=4)
    step = eqx.filter_jit(lambda m, t, c: m.decode_step(t, c))
    outs = []
    for t in range(4):
        out, cache = step(m, _TGT[:, t : t + 1], cache)
        outs.append(out)
    _close(jnp.concatenate(outs, axis=1), full)


@pytest.mark.parametrize("config", ["EncoderDecoderConfig", "EncoderConfig"])
def test_relative_bias_option_refused_by_name(config):
    from blocklab.models import encoder_config

    cls = getattr(encoder_config, config)
    with pytest.raises(
        ConfigError, match=r"relative_bias.*'shared', 'per_layer'.*'layer'"
    ):
        cls(40, 16, 4, 2, relative_bias="layer", positions="relative")
    with pytest.raises(ConfigError, match="positions='relative'"):
        cls(40, 16, 4, 2, relative_bias="per_layer", positions="none")


@pytest.mark.parametrize("family", ["T5", "UMT5"])
def test_t5_encoder_model_states_and_folder(tmp_path, family):
    """T5EncoderModel and UMT5EncoderModel convert to an EncoderModel (one
    relative bias table, or one per layer; a final norm, no head):
    last_hidden_state at the real tokens of a ragged
    batch, from the model, through a folder transformers loads, and from
    transformers' own folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    import blocklab
    from blocklab.models.encoder import EncoderModel

    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=40, d_model=12, d_kv=5, d_ff=20, num_layers=2, num_heads=3,
        relative_attention_num_buckets=12, relative_attention_max_distance=20,
        feed_forward_proj="gated-gelu", dropout_rate=0.1,
    )  # fmt: skip
    model_cls = getattr(transformers, f"{family}EncoderModel")
    hf = randomize(model_cls(cfg), seed=3, matrices=0.3)
    rng = np.random.default_rng(3)
    src, mask = _ragged(rng, 3, 7, 40)

    def states(m):
        with torch.no_grad():
            return m(
                input_ids=torch.tensor(src),
                attention_mask=torch.tensor(mask.astype(np.int64)),
            ).last_hidden_state.numpy()

    want = states(hf)
    ours = blocklab.from_huggingface(hf)
    assert isinstance(ours, EncoderModel) and ours.cfg.positions == "relative"
    per_layer = {"T5": "shared", "UMT5": "per_layer"}[family]
    assert ours.cfg.relative_bias == per_layer
    got = ours(jnp.asarray(src), key_mask=jnp.asarray(mask))
    _close(got, want, mask)
    blocklab.save_pretrained(ours, tmp_path / "ours")
    back = model_cls.from_pretrained(tmp_path / "ours").eval()
    _close(states(back), want, mask)
    hf.save_pretrained(tmp_path / "hf")
    folder = blocklab.load_pretrained(tmp_path / "hf")
    _close(folder(jnp.asarray(src), key_mask=jnp.asarray(mask)), want, mask)
