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


def _t5(seed, **fields):
    """A random tiny T5ForConditionalGeneration: widths, heads, d_kv (not
    d_model / heads), depths, buckets drawn from `seed`; random weights."""
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
    config = transformers.T5Config(**cfg)
    model = transformers.T5ForConditionalGeneration(config)
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


@pytest.mark.parametrize(
    "seed",
    [1, *(pytest.param(s, marks=pytest.mark.slow) for s in (0, *range(2, 8)))],
)
def test_t5_logits(seed):
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _t5(seed)
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
    enc = ours.encode(jnp.asarray(src), src_mask=jnp.asarray(mask))
    _close(enc, out.encoder_last_hidden_state.numpy(), mask)
    got = ours(jnp.asarray(src), jnp.asarray(tgt), src_mask=jnp.asarray(mask))
    _close(got, out.logits.numpy())


@pytest.mark.parametrize(
    "seed", [10, *(pytest.param(s, marks=pytest.mark.slow) for s in (11, 12, 13))]
)
def test_t5_greedy_equals_generate(seed):
    """20 greedy tokens on a ragged batch, token for token (after eos: pad).

    The decoder is not deeper than the encoder: transformers 5.24's generate
    sizes its cache by the encoder's depth (IndexError otherwise)."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _t5(seed, num_decoder_layers=None)
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


@pytest.mark.parametrize("tied", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_t5_folders_both_ways(tmp_path, tied):
    """transformers' save_pretrained -> load_pretrained (no torch on that
    path), and save_pretrained -> transformers' from_pretrained: equal logits
    both ways; v1.1's layout (an untied head, no output rescale) and v1.0's
    (tied, rescaled by d**-0.5)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    proj = "relu" if tied else "gated-gelu"
    hf, rng = _t5(4, tie_word_embeddings=tied, feed_forward_proj=proj)
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
    from blocklab.interop.t5 import t5_config

    base = dict(vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2)
    for ok in ("relu", "gated-gelu"):
        cfg = t5_config(transformers.T5Config(**base, feed_forward_proj=ok))
        assert cfg.block.act == {"relu": "relu", "gated-gelu": "geglu"}[ok]
    with pytest.raises(ConfigError, match=name):
        t5_config(transformers.T5Config(**base, **fields))


def test_umt5_refused_by_name():
    transformers = pytest.importorskip("transformers")
    import blocklab

    cfg = transformers.UMT5Config(
        vocab_size=20, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2
    )
    with pytest.raises(ConfigError, match="UMT5ForConditionalGeneration"):
        blocklab.from_huggingface(transformers.UMT5ForConditionalGeneration(cfg))


def test_t5_training_mode_refused():
    pytest.importorskip("torch")
    import blocklab

    hf, _ = _t5(0)
    with pytest.raises(ConfigError, match="dropout_rate"):
        blocklab.from_huggingface(hf.train())
