"""Attention options (GQA/MQA, head_dim, scale, RoPE, windows, QK-norm kinds) and the
blocks of GPT-2, Llama, OLMo 2 and Gemma 3 against references."""

import math

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl

T = 7

# (num_hiddens, num_heads, options); every option of MultiHeadAttention.
CONFIGS = {
    "gqa": (16, 4, dict(num_kv_heads=2)),
    "mqa": (16, 4, dict(num_kv_heads=1)),
    "head_dim": (16, 4, dict(head_dim=6, num_kv_heads=2)),
    "indivisible": (10, 4, dict(head_dim=4)),
    "scale": (16, 2, dict(attn_scale=0.3)),
    "window": (16, 4, dict(window=3)),
    "window0": (16, 4, dict(window=0)),
    "qk_head": (16, 4, dict(qk_norm="head", num_kv_heads=2)),
    "qk_full": (16, 4, dict(qk_norm="full", num_kv_heads=2)),
    "qk_gemma": (16, 4, dict(qk_norm=True, norm="gemma_rms")),
    "rope": (16, 4, dict(rope_theta=100.0, num_kv_heads=2)),
    "all": (
        12,
        4,
        dict(
            num_kv_heads=2,
            head_dim=4,
            attn_scale=0.4,
            rope_theta=1e4,
            window=2,
            qk_norm="full",
            norm="gemma_rms",
        ),
    ),
}
LENS = {
    "none": None,
    "causal": np.arange(1, T + 1),
    "ragged": np.array([7, 0, 3, 1, 7, 2, 5]),
}


def _random_attention(d, H, opts, rng, dtype=jnp.float64):
    mha = bl.MultiHeadAttention(d, H, key=jax.random.key(0), **opts)
    sd = {}
    for name in ("W_q", "W_k", "W_v", "W_o"):
        w = getattr(mha, name).weight
        sd[f"{name}.weight"] = rng.normal(0, 1 / math.sqrt(w.shape[1]), w.shape)
    for name in ("q_norm", "k_norm"):
        norm = getattr(mha, name)
        if norm is not None:
            base = 0.0 if norm.unit_offset else 1.0
            sd[f"{name}.weight"] = base + rng.normal(0, 0.3, norm.weight.shape)
    return bl.load_state_dict(mha, sd, dtype=dtype), sd


def _ref_options(opts):
    qk = opts.get("qk_norm", False)
    return dict(
        num_kv_heads=opts.get("num_kv_heads"),
        head_dim=opts.get("head_dim"),
        scale=opts.get("attn_scale"),
        rope_theta=opts.get("rope_theta"),
        window=opts.get("window"),
        qk_norm={False: None, True: "head"}.get(qk, qk),
        unit_offset=opts.get("norm") == "gemma_rms",
    )


# Each configuration with one kind of mask (rotating), the last with all three.
CASES = [(c, list(LENS)[i % 3]) for i, c in enumerate(CONFIGS)]
CASES += [("all", lens) for lens in LENS if ("all", lens) not in CASES]


@pytest.mark.parametrize(("config", "lens"), CASES)
@pytest.mark.float64
def test_trace_matches_the_float64_reference(config, lens):
    d, H, opts = CONFIGS[config]
    rng = np.random.default_rng(0)
    mha, sd = _random_attention(d, H, opts, rng)
    x = rng.normal(size=(T, d))
    positions = np.arange(3, 3 + T)  # a generation offset
    out, weights, logits = mha.trace(
        jnp.asarray(x), LENS[lens], positions=jnp.asarray(positions)
    )
    r_out, r_w, r_logits = ref.attention_general(
        sd, x, H, positions=positions, valid_lens=LENS[lens], **_ref_options(opts)
    )
    # RoPE's float32 cos/sin may differ by an ulp between XLA and NumPy.
    tol = 1e-6 if "rope_theta" in opts else 1e-11
    assert weights.shape == logits.shape == (H, T, T)
    np.testing.assert_allclose(logits, r_logits, rtol=tol, atol=tol)
    np.testing.assert_allclose(weights, r_w, rtol=tol, atol=tol)
    np.testing.assert_allclose(out, r_out, rtol=tol, atol=tol)


def test_shapes_and_attributes():
    mha = bl.MultiHeadAttention(
        12, 4, num_kv_heads=2, head_dim=5, qk_norm="full", key=jax.random.key(0)
    )
    assert (mha.head_dim, mha.num_kv_heads, mha.num_heads) == (5, 2, 4)
    assert mha.W_q.weight.shape == (20, 12)
    assert mha.W_k.weight.shape == mha.W_v.weight.shape == (10, 12)
    assert mha.W_o.weight.shape == (12, 20)
    assert mha.q_norm.weight.shape == (20,) and mha.k_norm.weight.shape == (10,)
    assert mha.scale == 1 / math.sqrt(5)
    head = bl.MultiHeadAttention(12, 4, head_dim=5, qk_norm=True, key=jax.random.key(0))
    assert head.q_norm.weight.shape == head.k_norm.weight.shape == (5,)
    gemma = bl.MultiHeadAttention(
        8, 2, qk_norm="head", norm="gemma_rms", key=jax.random.key(0)
    )
    np.testing.assert_array_equal(gemma.q_norm.weight, 0.0)  # gain 1 + 0


def test_rope_theta_and_window_are_integer_leaves_skipped_by_filters():
    mha = bl.MultiHeadAttention(8, 2, rope_theta=1e6, window=4, key=jax.random.key(0))
    assert mha.window.dtype == jnp.int32 and int(mha.window) == 4
    assert mha.rope_theta.dtype == jnp.int32
    theta = jax.lax.bitcast_convert_type(mha.rope_theta, jnp.float32)
    assert float(theta) == 1e6
    params = eqx.filter(mha, eqx.is_inexact_array)
    assert params.window is None and params.rope_theta is None
    plain = bl.MultiHeadAttention(8, 2, key=jax.random.key(0))
    assert plain.window is None and plain.rope_theta is None
    assert bl.count_params(mha) == bl.count_params(plain)


def test_window_one_sees_only_itself_and_zero_is_global():
    x = jax.random.normal(jax.random.key(1), (T, 8))
    w1 = bl.MultiHeadAttention(8, 2, window=1, key=jax.random.key(0)).trace(x)
    np.testing.assert_array_equal(w1.weights, np.broadcast_to(np.eye(T), (2, T, T)))
    w0 = bl.MultiHeadAttention(8, 2, window=0, key=jax.random.key(0)).trace(x)
    none = bl.MultiHeadAttention(8, 2, key=jax.random.key(0)).trace(x)
    np.testing.assert_array_equal(w0.weights, none.weights)


def test_per_layer_settings_inside_one_scanned_stack():
    """Gemma 3's pattern: one scan, local and global layers differing in data."""
    opts = dict(num_kv_heads=1, rope_theta=1e4, window=2)

    def make(key):
        return bl.TransformerBlock(16, 2, key=key, **opts)

    stack = bl.Stack(make, 3, key=jax.random.key(0))
    window = jnp.array([2, 0, 2], jnp.int32)  # layer 1 is global ...
    theta = jnp.array([1e4, 1e6, 1e4], jnp.float32)  # ... with another theta
    stack = eqx.tree_at(
        lambda s: (s.blocks.attention.window, s.blocks.attention.rope_theta),
        stack,
        (window, jax.lax.bitcast_convert_type(theta, jnp.int32)),
    )
    x = jax.random.normal(jax.random.key(1), (T, 16))
    causal = jnp.arange(1, T + 1)
    h = x
    for i in range(3):
        blk = stack[i]
        local = dict(opts, window=int(window[i]), rope_theta=float(theta[i]))
        ref_blk = bl.TransformerBlock(16, 2, key=jax.random.key(9), **local)
        params = eqx.filter(blk, eqx.is_inexact_array)
        ref_blk = eqx.combine(
            params, eqx.filter(ref_blk, eqx.is_inexact_array, inverse=True)
        )
        h = ref_blk(h, causal)
    np.testing.assert_allclose(stack(x, causal), h, rtol=1e-5, atol=1e-6)
    # The settings matter: all-global layers give something else.
    glob = eqx.tree_at(
        lambda s: s.blocks.attention.window, stack, jnp.zeros(3, jnp.int32)
    )
    assert not np.allclose(glob(x, causal), h, atol=1e-3)


def test_batched_lengths_per_sequence_and_positions():
    d, H, opts = CONFIGS["all"]
    mha, _ = _random_attention(d, H, opts, np.random.default_rng(1), jnp.float32)
    xs = jnp.asarray(np.random.default_rng(2).normal(size=(3, T, d)), jnp.float32)
    lens = jnp.array([[7], [2], [5]])  # one length per sequence: shape (B, 1)
    pos = jnp.stack([jnp.arange(T) + s for s in (0, 4, 9)])
    got = mha(xs, lens, positions=pos)
    # float32 rows equal to the last bit: the batch runs each row's own sums
    assert got.dtype == jnp.float32
    for b in range(3):
        one = mha(xs[b], lens[b, 0], positions=pos[b])
        np.testing.assert_allclose(got[b], one, rtol=1e-12, atol=1e-12)
    per_query = jnp.broadcast_to(jnp.arange(1, T + 1), (3, T))  # (B, T)
    np.testing.assert_allclose(
        mha(xs, per_query, positions=pos),
        jax.vmap(lambda x, p: mha(x, jnp.arange(1, T + 1), positions=p))(xs, pos),
        rtol=1e-12,
        atol=1e-12,
    )


def test_block_forwards_options_and_separate_biases():
    blk = bl.TransformerBlock(
        12,
        4,
        num_kv_heads=2,
        head_dim=4,
        ffn_width=20,
        attn_scale=0.5,
        rope_theta=1e4,
        window=3,
        attn_bias=True,
        ffn_bias=False,
        qk_norm="full",
        norm="gemma_rms",
        norm_eps=1e-5,
        key=jax.random.key(0),
    )
    att = blk.attention
    assert (att.num_kv_heads, att.head_dim, att.scale) == (2, 4, 0.5)
    assert int(att.window) == 3 and att.W_q.bias is not None
    assert att.q_norm.unit_offset and att.q_norm.eps == 1e-5
    assert att.q_norm.weight.shape == (16,)
    assert blk.ffn.width == 20 and blk.ffn.W_1.bias is None
    assert blk.norm1.unit_offset
    x = jax.random.normal(jax.random.key(1), (2, T, 12))
    pos = jnp.arange(5, 5 + T)
    tr = blk.trace(x, jnp.arange(1, T + 1), positions=pos)
    np.testing.assert_array_equal(
        tr.attention.output,
        att.trace(blk.norm1(x), jnp.arange(1, T + 1), positions=pos).output,
    )
    assert tr.ffn_trace is None  # FeedForward has no trace method
    # positions reach RoPE: packed positions (not a uniform shift, to which
    # RoPE is blind) change the output
    packed = jnp.array([0, 1, 2, 0, 1, 2, 3])
    assert not np.allclose(blk(x, positions=packed), blk(x), atol=1e-4)


def test_block_ffn_trace_and_positions_only_when_given():
    class TracedFFN(eqx.Module):
        scale: jax.Array

        def trace(self, x, *, key=None):
            class Out(eqx.Module):
                output: jax.Array
                stat: jax.Array

            return Out(x * self.scale, jnp.mean(x))

        def __call__(self, x, *, key=None):
            return self.trace(x, key=key).output

    class PlainAttention(eqx.Module):  # accepts no `positions`
        def __call__(self, x, valid_lens=None, *, key=None):
            return 2 * x

    blk = bl.TransformerBlock(
        8,
        2,
        attn_factory=lambda key: PlainAttention(),
        ffn_factory=lambda key: TracedFFN(jnp.float32(3.0)),
        key=jax.random.key(0),
    )
    x = jax.random.normal(jax.random.key(1), (T, 8))
    tr = blk.trace(x)
    h = x + 2 * blk.norm1(x)
    np.testing.assert_allclose(tr.ffn_trace.stat, jnp.mean(blk.norm2(h)), rtol=1e-6)
    np.testing.assert_allclose(tr.output, h + 3 * blk.norm2(h), rtol=1e-6)
    # The statistics come out of a scanned stack too.
    stack = bl.Stack(
        lambda k: bl.TransformerBlock(
            8, 2, ffn_factory=lambda key: TracedFFN(jnp.float32(0.5)), key=k
        ),
        3,
        key=jax.random.key(0),
    )
    _, stats = stack.scan(
        x, collect=lambda b, h, k: (lambda t: (t.output, t.ffn_trace.stat))(b.trace(h))
    )
    assert stats.shape == (3,)
    with pytest.raises(TypeError):  # a custom attention given positions
        blk(x, positions=jnp.arange(T))


# ------------------------------------------------------ transformers layers
def _hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    return torch, transformers


def _randomize(torch, layer, gemma=False):
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "norm" in name or name.startswith("ln_"):
                base = 0.0 if gemma or name.endswith("bias") else 1.0
                p.copy_(base + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05)
    return layer.eval()


def _mask(torch, T, window=None):
    q, k = torch.arange(T)[:, None], torch.arange(T)[None, :]
    ok = k <= q
    if window is not None:
        ok = ok & (k > q - window)
    return torch.where(ok, 0.0, torch.finfo(torch.float32).min)[None, None]


_LLAMA_NAMES = {
    "attention.W_q.weight": "self_attn.q_proj.weight",
    "attention.W_k.weight": "self_attn.k_proj.weight",
    "attention.W_v.weight": "self_attn.v_proj.weight",
    "attention.W_o.weight": "self_attn.o_proj.weight",
    "ffn.W_g.weight": "mlp.gate_proj.weight",
    "ffn.W_1.weight": "mlp.up_proj.weight",
    "ffn.W_2.weight": "mlp.down_proj.weight",
}
_NORM_NAMES = {
    "llama": {
        "norm1.weight": "input_layernorm.weight",
        "norm2.weight": "post_attention_layernorm.weight",
    },
    "olmo2": {
        "norm1.weight": "post_attention_layernorm.weight",
        "norm2.weight": "post_feedforward_layernorm.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    },
    "gemma3": {
        "norm1.weight": "input_layernorm.weight",
        "out_norm1.weight": "post_attention_layernorm.weight",
        "norm2.weight": "pre_feedforward_layernorm.weight",
        "out_norm2.weight": "post_feedforward_layernorm.weight",
        "attention.q_norm.weight": "self_attn.q_norm.weight",
        "attention.k_norm.weight": "self_attn.k_norm.weight",
    },
}
D, H, KV, W = 32, 4, 2, 3


def _hf_layer(family, torch, tf, layer_type=None):
    """(transformers layer output on x, our block, x) for one family."""
    from transformers.models.gemma3 import modeling_gemma3 as g3
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama import modeling_llama as ll
    from transformers.models.olmo2 import modeling_olmo2 as ol

    torch.manual_seed(0)
    B = 2
    x = torch.randn(B, T, D)
    pos = torch.arange(T)[None]
    common = dict(
        hidden_size=D,
        intermediate_size=40,
        num_attention_heads=H,
        num_key_value_heads=KV,
        num_hidden_layers=2,
        vocab_size=16,
        attn_implementation="eager",
    )
    key = jax.random.key(0)
    if family == "gpt2":
        cfg = tf.GPT2Config(
            n_embd=D, n_head=H, n_layer=1, resid_pdrop=0.0, attn_pdrop=0.0,
            embd_pdrop=0.0, attn_implementation="eager",
        )  # fmt: skip
        layer = _randomize(torch, GPT2Block(cfg, layer_idx=0))
        with torch.no_grad():
            y = layer(x, attention_mask=_mask(torch, T))
        s = {k: v.numpy() for k, v in layer.state_dict().items()}
        sd = {
            "attention.W_o.weight": s["attn.c_proj.weight"].T,
            "attention.W_o.bias": s["attn.c_proj.bias"],
            "ffn.W_1.weight": s["mlp.c_fc.weight"].T,
            "ffn.W_1.bias": s["mlp.c_fc.bias"],
            "ffn.W_2.weight": s["mlp.c_proj.weight"].T,
            "ffn.W_2.bias": s["mlp.c_proj.bias"],
        }
        for i in (1, 2):
            sd[f"norm{i}.weight"] = s[f"ln_{i}.weight"]
            sd[f"norm{i}.bias"] = s[f"ln_{i}.bias"]
        for i, n in enumerate("qkv"):  # Conv1D (in, out): split the columns
            sd[f"attention.W_{n}.weight"] = s["attn.c_attn.weight"][
                :, i * D : (i + 1) * D
            ].T
            sd[f"attention.W_{n}.bias"] = s["attn.c_attn.bias"][i * D : (i + 1) * D]
        blk = bl.TransformerBlock(
            D, H, norm="layer", act="gelu", bias=True, norm_eps=1e-5, key=key
        )
    elif family in ("llama", "olmo2"):
        mod, cls = (ll, "Llama") if family == "llama" else (ol, "Olmo2")
        cfg = getattr(tf, f"{cls}Config")(**common)
        layer = _randomize(torch, getattr(mod, f"{cls}DecoderLayer")(cfg, layer_idx=0))
        cos_sin = getattr(mod, f"{cls}RotaryEmbedding")(config=cfg)(x, pos)
        with torch.no_grad():
            y = layer(x, attention_mask=_mask(torch, T), position_embeddings=cos_sin)
        opts = dict(num_kv_heads=KV, rope_theta=10000.0, ffn_width=40)
        if family == "olmo2":
            opts.update(placement="output", qk_norm="full", norm_eps=1e-5)
        blk = bl.TransformerBlock(D, H, key=key, **opts)
    else:
        cfg = tf.Gemma3TextConfig(
            head_dim=12, query_pre_attn_scalar=20, sliding_window=W,
            layer_types=["sliding_attention", "full_attention"], **common,
        )  # fmt: skip
        idx = cfg.layer_types.index(layer_type)
        layer = _randomize(torch, g3.Gemma3DecoderLayer(cfg, layer_idx=idx), True)
        cos_sin = g3.Gemma3RotaryEmbedding(cfg)(x, pos, layer_type)
        local = layer_type == "sliding_attention"
        with torch.no_grad():
            y = layer(
                x,
                attention_mask=_mask(torch, T, W if local else None),
                position_embeddings=cos_sin,
            )
        blk = bl.TransformerBlock(
            D, H, num_kv_heads=KV, head_dim=12, attn_scale=20**-0.5,
            rope_theta=1e4 if local else 1e6, window=W if local else None,
            ffn_width=40, act="geglu", norm="gemma_rms", placement="sandwich",
            qk_norm="head", key=key,
        )  # fmt: skip
    if family != "gpt2":
        s = {k: v.numpy() for k, v in layer.state_dict().items()}
        names = dict(_LLAMA_NAMES, **_NORM_NAMES[family])
        sd = {ours: s[theirs] for ours, theirs in names.items()}
    y = y[0] if isinstance(y, tuple) else y
    return y.numpy(), bl.load_state_dict(blk, sd), x.numpy()


@pytest.mark.parametrize(
    ("family", "layer_type"),
    [
        ("gpt2", None),
        ("llama", None),
        ("olmo2", None),
        ("gemma3", "sliding_attention"),
        ("gemma3", "full_attention"),
    ],
)
def test_block_matches_the_transformers_decoder_layer(family, layer_type):
    torch, tf = _hf()
    want, blk, x = _hf_layer(family, torch, tf, layer_type)
    causal = jnp.arange(1, T + 1)
    got = blk(jnp.asarray(x), causal)
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    # and one sequence of the batch on its own
    np.testing.assert_allclose(
        blk(jnp.asarray(x[1]), causal), want[1], atol=1e-5 * scale
    )
