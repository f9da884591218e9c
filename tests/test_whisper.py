"""Whisper: the audio front-end, the family's conversion, generation, folders.

References: PyTorch's `conv1d`, the sinusoids' closed form in float64 (and
`transformers`' own table), `WhisperForConditionalGeneration` with random
weights and random small configs, and a plain argmax loop on its forward
(no cache: every step recomputes the whole target) for greedy decoding.
"""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blocklab._validate import ConfigError
from blocklab.models.encoder_config import EncoderDecoderConfig
from blocklab.models.encoder_decoder import EncoderDecoderLM
from blocklab.nn.audio_embed import AudioEmbedding, conv1d, sinusoids
from blocklab.training.losses import seq2seq_loss


def _close(got, want):
    """|got - want| <= 1e-5 x the scale of want."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = max(float(np.abs(want).max()), 1.0)
    err = float(np.abs(got - want).max())
    assert err <= 1e-5 * scale, f"max |diff| {err:.3g} > 1e-5 x scale {scale:.3g}"


# The front-end -----------------------------------------------------------------


def test_sinusoids_closed_form():
    """Row t: sin(t w_i) for i < c, then cos(t w_i), w_i = 10000^(-i/(c-1)),
    written out in float64; and transformers' float32 table within its own
    rounding (its frequencies are float32: |error| <= about t 2^-23)."""
    L, C = 40, 12
    c = C // 2
    want = np.empty((L, C))
    for t in range(L):
        for i in range(c):
            w = 10000.0 ** (-i / (c - 1))
            want[t, i], want[t, c + i] = math.sin(t * w), math.cos(t * w)
    got = np.asarray(sinusoids(L, C))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, atol=6e-8)
    torch = pytest.importorskip("torch")
    whisper = pytest.importorskip("transformers.models.whisper.modeling_whisper")
    with torch.no_grad():
        theirs = whisper.sinusoids(L, C).numpy()
    np.testing.assert_allclose(got, theirs, atol=L * 2.0**-23)
    for bad in (3, 2, 7):
        with pytest.raises(ConfigError, match="channels"):
            sinusoids(4, bad)


@pytest.mark.parametrize("L,stride", [(10, 1), (10, 2), (9, 2), (1, 2)])
def test_conv1d_matches_torch(L, stride):
    """Kernel 3, padding 1, strides 1 and 2, odd and even lengths, a batch."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(L + stride)
    x = rng.normal(size=(2, 5, L)).astype(np.float32)
    w = rng.normal(size=(7, 5, 3)).astype(np.float32)
    b = rng.normal(size=7).astype(np.float32)
    want = torch.nn.functional.conv1d(
        torch.tensor(x), torch.tensor(w), torch.tensor(b), stride=stride, padding=1
    ).numpy()
    x, w, b = (jnp.asarray(a) for a in (x, w, b))
    got = conv1d(x.swapaxes(-1, -2), w, b, stride=stride)
    _close(np.asarray(got).swapaxes(-1, -2), want)


def test_audio_embedding_checks_and_freezes_positions():
    emb = AudioEmbedding(3, 8, 5, key=jax.random.key(0))
    x = jnp.ones((2, 3, 10))
    for bad in (jnp.ones((2, 3, 9)), jnp.ones((2, 4, 10)), jnp.ones((3, 11))):
        with pytest.raises(ConfigError, match="AudioEmbedding"):
            emb(bad)
    # transformers freezes the stored sinusoids; so does the front-end
    out, grad = jax.jit(jax.value_and_grad(lambda m: m(x).sum()))(emb)
    assert not np.any(np.asarray(grad.pos_emb))
    assert np.any(np.asarray(grad.conv1_weight))


# The family against transformers ---------------------------------------------------


def _whisper(seed, **fields):
    """A random tiny WhisperForConditionalGeneration: width, heads, mel bins,
    source and target lengths, encoder and decoder depths, activation and
    tying drawn from `seed`; random weights (the stored sinusoids too)."""
    transformers = pytest.importorskip("transformers")
    from hf_models import randomize

    rng = np.random.default_rng(seed)
    heads = int(rng.choice([1, 2, 4]))
    ffn = int(rng.integers(6, 40))
    cfg = dict(
        vocab_size=int(rng.integers(30, 80)),
        num_mel_bins=int(rng.choice([3, 5, 8])),
        d_model=heads * int(rng.choice([2, 4, 6])),
        encoder_layers=int(rng.integers(1, 4)),
        decoder_layers=int(rng.integers(1, 4)),
        encoder_attention_heads=heads,
        decoder_attention_heads=heads,
        encoder_ffn_dim=ffn,
        decoder_ffn_dim=ffn,
        max_source_positions=int(rng.integers(2, 12)),
        max_target_positions=int(rng.integers(24, 40)),
        activation_function=str(rng.choice(["gelu", "gelu_new", "relu"])),
        tie_word_embeddings=bool(rng.integers(0, 2)),
        decoder_start_token_id=1,
        pad_token_id=0,
        bos_token_id=0,
        eos_token_id=2,
        dropout=0.1,
    )
    if cfg["d_model"] < 4:
        cfg["d_model"] = 4 * heads
    cfg.update(fields)
    config = transformers.WhisperConfig(**cfg)
    model = transformers.WhisperForConditionalGeneration(config)
    return randomize(model, seed=seed, matrices=0.3, embeddings=1.0), rng


def _features(rng, hf, B):
    c = hf.config
    return rng.normal(size=(B, c.num_mel_bins, 2 * c.max_source_positions)).astype(
        np.float32
    )


@pytest.mark.parametrize(
    "seed",
    [1, *(pytest.param(s, marks=pytest.mark.slow) for s in (0, *range(2, 9)))],
)
def test_whisper_logits(seed):
    """Encoder states and logits of a batch, <= 1e-5 x scale."""
    torch = pytest.importorskip("torch")
    import blocklab

    hf, rng = _whisper(seed)
    c = hf.config
    x = _features(rng, hf, 3)
    tgt = rng.integers(0, c.vocab_size, size=(3, int(rng.integers(1, 9))))
    with torch.no_grad():
        out = hf(input_features=torch.tensor(x), decoder_input_ids=torch.tensor(tgt))
    ours = blocklab.from_huggingface(hf)
    untied = (
        hf.proj_out.weight.data_ptr() != hf.model.decoder.embed_tokens.weight.data_ptr()
    )
    assert ours.cfg.tie_embeddings is not untied
    assert ours.cfg.num_decoder_blks == c.decoder_layers
    _close(ours.encode(jnp.asarray(x)), out.encoder_last_hidden_state.numpy())
    _close(ours(jnp.asarray(x), jnp.asarray(tgt)), out.logits.numpy())
    if seed == 1:  # the loss of transformers' labels (shifted behind the start)
        labels = tgt.copy()
        labels[0, -1] = -100  # ignored
        with torch.no_grad():
            want = hf(input_features=torch.tensor(x), labels=torch.tensor(labels))
        tgt_in = np.concatenate([np.full((3, 1), 1), tgt[:, :-1]], axis=1)
        got = seq2seq_loss(ours, jnp.asarray(x), tgt_in, labels)
        _close(got, want.loss.numpy())


def _argmax_loop(hf, x, prompt, n):
    """`n` greedy tokens from transformers' forward without a cache (every
    step recomputes the whole target), without an end token."""
    import torch

    ids = torch.tensor(prompt)
    with torch.no_grad():
        enc = hf.model.encoder(torch.tensor(x)).last_hidden_state
        for _ in range(n):
            out = hf(encoder_outputs=(enc,), decoder_input_ids=ids, use_cache=False)
            nxt = out.logits[:, -1].argmax(-1)
            ids = torch.cat([ids, nxt[:, None]], dim=1)
    return ids[:, len(prompt[0]) :].numpy()


@pytest.mark.parametrize(
    "seed", [3, *(pytest.param(s, marks=pytest.mark.slow) for s in (4, 5, 6))]
)
def test_whisper_greedy_equals_argmax_loop(seed):
    """20 tokens after a 3-token prompt (Whisper's start, language and task
    tokens), batch 3, cached (one decode_step per token, learned positions
    offset by the cache length) against transformers recomputing the whole
    target every step. The end token is one the model emits mid-way, so the
    pad-after-end rule is exercised."""
    pytest.importorskip("torch")
    import blocklab

    hf, rng = _whisper(seed)
    c = hf.config
    x = _features(rng, hf, 3)
    prompt = np.stack([[1, *rng.integers(3, c.vocab_size, size=2)] for _ in range(3)])
    free = _argmax_loop(hf, x, prompt, 20)
    eos = int(free[0, 6])
    # after its first end token a sequence emits pad (0), as generate does;
    # the tokens before it do not depend on what follows
    ended = np.cumsum(free == eos, axis=1) - (free == eos) > 0
    want = np.where(ended, 0, free)
    hf.config.eos_token_id = eos
    ours = blocklab.from_huggingface(hf)
    assert (ours.cfg.eos_token_id, ours.cfg.pad_token_id) == (eos, 0)
    got = ours.greedy(jnp.asarray(x), 20, prompt_ids=jnp.asarray(prompt))
    np.testing.assert_array_equal(np.asarray(got), want)
    assert (want == 0).any()  # some sequence ended and was padded


@pytest.mark.parametrize("tied", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_whisper_folders_both_ways(tmp_path, tied):
    """transformers' save_pretrained -> load_pretrained (no torch on that
    path) and save_pretrained -> transformers' from_pretrained, equal logits
    both ways; the stored key biases are absent, the tied head too."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    import blocklab

    hf, rng = _whisper(7, tie_word_embeddings=tied)
    x = _features(rng, hf, 2)
    tgt = rng.integers(0, hf.config.vocab_size, size=(2, 5))

    def hf_logits(m):
        with torch.no_grad():
            return m(
                input_features=torch.tensor(x), decoder_input_ids=torch.tensor(tgt)
            ).logits.numpy()

    hf.save_pretrained(tmp_path / "hf")
    ours = blocklab.load_pretrained(tmp_path / "hf")
    assert ours.cfg.tie_embeddings is tied
    got = ours(jnp.asarray(x), jnp.asarray(tgt))
    _close(got, hf_logits(hf))
    blocklab.save_pretrained(ours, tmp_path / "ours")
    with safe_open(tmp_path / "ours" / "model.safetensors", "np") as f:
        keys = set(f.keys())
    with safe_open(tmp_path / "hf" / "model.safetensors", "np") as f:
        assert keys == set(f.keys())
    back = transformers.WhisperForConditionalGeneration.from_pretrained(
        tmp_path / "ours"
    )
    _close(hf_logits(back.eval()), got)


def test_nonzero_key_bias_not_exported():
    """Whisper's keys have no bias; a model whose key bias moved is refused
    by name (its logits would be the same, but the file could not hold it)."""
    import equinox as eqx

    import blocklab

    hf, _ = _whisper(2)
    ours = blocklab.from_huggingface(hf)
    moved = eqx.tree_at(
        lambda m: m.decoder.blocks.cross_attn.W_k.bias,
        ours,
        ours.decoder.blocks.cross_attn.W_k.bias + 1.0,
    )
    with pytest.raises(ConfigError, match="cross_attn.W_k.bias"):
        blocklab.to_huggingface_state_dict(moved)


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(scale_embedding=True), "scale_embedding"),
        (dict(activation_function="silu"), "activation_function"),
        (dict(decoder_attention_heads=1), "decoder_attention_heads"),
        (dict(decoder_ffn_dim=9), "decoder_ffn_dim"),
        (dict(some_new_option=3), "some_new_option"),
    ],
)
def test_whisper_unimplemented_fields_refused_by_name(fields, name):
    transformers = pytest.importorskip("transformers")
    from blocklab.interop.families.whisper import whisper_config

    base = dict(vocab_size=20, num_mel_bins=4, d_model=8, encoder_layers=1,
                decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=8, decoder_ffn_dim=8,
                max_source_positions=3, max_target_positions=10)  # fmt: skip
    cfg = whisper_config(transformers.WhisperConfig(**base))
    assert (cfg.src_input, cfg.positions, cfg.block.act) == (
        "audio",
        "learned",
        "gelu_exact",
    )
    with pytest.raises(ConfigError, match=name):
        whisper_config(transformers.WhisperConfig(**{**base, **fields}))


def test_whisper_other_classes_and_training_mode_refused():
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import blocklab

    hf, _ = _whisper(0)
    with pytest.raises(ConfigError, match="dropout"):
        blocklab.from_huggingface(hf.train())
    with pytest.raises(ConfigError, match="WhisperForCausalLM"):
        causal = transformers.WhisperForCausalLM(copy.deepcopy(hf.config))
        blocklab.from_huggingface(causal)


# The options of EncoderDecoderConfig -----------------------------------------------

_AUDIO = dict(src_input="audio", num_mel_bins=4, max_source_len=3)


@pytest.mark.parametrize(
    "fields,name",
    [
        (dict(src_input="video"), "src_input"),
        (dict(src_input="audio", max_source_len=3), "num_mel_bins"),
        (dict(src_input="audio", num_mel_bins=4), "max_source_len"),
        (dict(max_source_len=3), "max_source_len"),
        (dict(num_mel_bins=80), "num_mel_bins"),
        (dict(positions="learned"), "positions"),
        (dict(_AUDIO, num_hiddens=2, num_heads=1), "num_hiddens"),
    ],
)
def test_config_source_options_checked(fields, name):
    args = dict(num_hiddens=8, num_heads=2)
    args.update(fields)
    d, H = args.pop("num_hiddens"), args.pop("num_heads")
    with pytest.raises(ConfigError, match=name):
        EncoderDecoderConfig(20, d, H, 1, **args)


def test_audio_model_refuses_masks_and_long_targets():
    cfg = EncoderDecoderConfig(20, 8, 2, 1, positions="learned", max_len=4, **_AUDIO)
    model = EncoderDecoderLM(cfg, key=jax.random.key(0))
    x = jnp.ones((4, 6))
    with pytest.raises(ConfigError, match="src_mask"):
        model.encode(x, src_mask=jnp.ones(3, bool))
    with pytest.raises(ConfigError, match="max_len=4"):
        model.decode(jnp.zeros(5, int), jnp.zeros((3, 8)))
    with pytest.raises(ConfigError, match="max_len"):
        model.init_cache(jnp.zeros((3, 8)), max_len=5)


def test_logical_axes_cover_the_audio_front_end_and_decoder_positions():
    """Every array of a Whisper-shaped model has logical axes, and the fsdp
    and tp presets lay them out (no mesh axis used twice by one array)."""
    from blocklab.training.placement import logical_axes, param_shardings

    cfg = EncoderDecoderConfig(20, 8, 2, 1, positions="learned", max_len=4, **_AUDIO)
    model = EncoderDecoderLM(cfg, key=jax.random.key(0))
    axes = logical_axes(model)
    assert tuple(axes.audio_emb.conv1_weight) == ("embed", None, None)
    assert tuple(axes.audio_emb.conv2_weight) == ("embed", None, None)
    assert tuple(axes.audio_emb.pos_emb) == ("position", "embed")
    assert tuple(axes.dec_pos_emb.weight) == ("position", "embed")
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    param_shardings(model, mesh, "fsdp+tp")
