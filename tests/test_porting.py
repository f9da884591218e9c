"""Porting PyTorch-style state dicts: names, shapes, errors and the same output."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference as ref

import blocklab as bl
from blocklab._validate import ConfigError

D, H, T = 16, 4, 6
KEY = jax.random.key(0)

# The keys of the chapter's PyTorch TransformerBlock(32, 4) state_dict, written
# out by hand from its __init__ (d2l.MultiHeadAttention has W_q, W_k, W_v, W_o;
# its DotProductAttention and the dropouts hold no parameters).
TORCH_KEYS_MODERN = {
    "norm1.weight", "norm2.weight",
    "attention.W_q.weight", "attention.W_k.weight",
    "attention.W_v.weight", "attention.W_o.weight",
    "ffn.W_g.weight", "ffn.W_1.weight", "ffn.W_2.weight",
}  # fmt: skip
TORCH_KEYS_2017 = {
    "norm1.weight", "norm1.bias", "norm2.weight", "norm2.bias",
    *(f"attention.{w}.{p}" for w in ("W_q", "W_k", "W_v", "W_o")
      for p in ("weight", "bias")),
    "ffn.W_1.weight", "ffn.W_1.bias", "ffn.W_2.weight", "ffn.W_2.bias",
}  # fmt: skip
CHAPTER = {
    "modern": dict(norm="rms", act="swiglu", placement="pre", bias=False),
    "2017": dict(norm="layer", act="gelu", placement="post", bias=True),
}


def _torch_like(config, seed=0):
    """A float32 'PyTorch' state dict for the chapter's block, as NumPy arrays."""
    c = CHAPTER[config]
    return ref.random_state_dict(
        np.random.default_rng(seed), D, norm_kind=c["norm"], act=c["act"],
        placement=c["placement"], bias=c["bias"], dtype=np.float32,
    )  # fmt: skip


@pytest.mark.parametrize("config", CHAPTER)
def test_key_names_are_the_chapter_pytorch_names(config):
    blk = bl.TransformerBlock(D, H, key=KEY, **CHAPTER[config])
    want = TORCH_KEYS_MODERN if config == "modern" else TORCH_KEYS_2017
    assert set(bl.state_dict(blk)) == want
    ffn_width = round(8 * D / 3) if config == "modern" else 4 * D
    assert bl.state_dict(blk)["ffn.W_1.weight"].shape == (ffn_width, D)  # (out, in)


@pytest.mark.parametrize("config", CHAPTER)
@pytest.mark.parametrize(
    "valid_lens", [None, 5, np.arange(1, T + 1)], ids=["none", "5", "causal"]
)
def test_ported_block_reproduces_the_reference_output(config, valid_lens):
    sd = _torch_like(config)
    blk = bl.load_state_dict(bl.TransformerBlock(D, H, key=KEY, **CHAPTER[config]), sd)
    x = np.random.default_rng(1).normal(size=(T, D)).astype(np.float32)
    c = CHAPTER[config]
    want = ref.block(
        sd, x, H, norm_kind=c["norm"], act=c["act"], placement=c["placement"],
        valid_lens=valid_lens,
    )  # fmt: skip
    got = blk(jnp.asarray(x), valid_lens)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_round_trip_is_exact_and_the_input_module_is_unchanged():
    sd = _torch_like("2017")
    blk = bl.TransformerBlock(D, H, key=KEY, **CHAPTER["2017"])
    before = bl.state_dict(blk)
    ported = bl.load_state_dict(blk, sd)
    out = bl.state_dict(ported)
    assert out.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(out[k], sd[k])
        assert out[k].dtype == np.float32
        np.testing.assert_array_equal(bl.state_dict(blk)[k], before[k])
    assert jax.tree_util.tree_structure(ported) == jax.tree_util.tree_structure(blk)


def test_dtype_option_casts_and_default_keeps_the_module_dtype():
    sd = {k: v.astype(np.float64) for k, v in _torch_like("modern").items()}
    blk = bl.TransformerBlock(D, H, key=KEY)
    assert bl.load_state_dict(blk, sd).attention.W_q.weight.dtype == jnp.float32
    half = bl.load_state_dict(blk, sd, dtype=jnp.bfloat16)
    assert {v.dtype for v in bl.state_dict(half).values()} == {np.dtype(jnp.bfloat16)}


def test_missing_key_is_named():
    sd = _torch_like("modern")
    del sd["ffn.W_g.weight"]
    with pytest.raises(ValueError, match=r"missing keys \['ffn.W_g.weight'\]"):
        bl.load_state_dict(bl.TransformerBlock(D, H, key=KEY), sd)


def test_unexpected_key_is_named():
    sd = _torch_like("modern")
    sd["attention.W_q.bias"] = np.zeros(D, np.float32)  # a bias=True checkpoint
    with pytest.raises(
        ValueError,
        match=r"unexpected keys \['attention.W_q.bias'\]\. The module's keys are",
    ):
        bl.load_state_dict(bl.TransformerBlock(D, H, key=KEY), sd)


def test_shape_mismatch_names_the_key_and_both_shapes():
    sd = _torch_like("modern")
    sd["ffn.W_2.weight"] = sd["ffn.W_2.weight"].T  # (in, out): a Flax/JAX layout
    with pytest.raises(
        ConfigError,  # a bad argument (a ValueError subclass)
        match=r"shape mismatch for key 'ffn.W_2.weight': the state dict has shape "
        r"\(43, 16\), the module expects shape \(16, 43\)",
    ):
        bl.load_state_dict(bl.TransformerBlock(D, H, key=KEY), sd)


@pytest.mark.float64  # a NumPy float64 reference at 1e-10
def test_sandwich_and_qk_norm_parameters_port_too():
    rng = np.random.default_rng(2)
    sd = ref.random_state_dict(rng, D, placement="sandwich", dtype=np.float64)
    ref.add_qk_norm(sd, rng, D // H, dtype=np.float64)
    blk = bl.TransformerBlock(D, H, placement="sandwich", qk_norm=True, key=KEY)
    assert set(bl.state_dict(blk)) == set(sd)
    ported = bl.load_state_dict(blk, sd, dtype=jnp.float64)
    x = rng.normal(size=(T, D))
    want = ref.block(sd, x, H, norm_kind="rms", act="swiglu", placement="sandwich")
    np.testing.assert_allclose(ported(jnp.asarray(x)), want, rtol=1e-10, atol=1e-10)


@pytest.fixture(scope="module")
def stack():
    return bl.Stack(lambda k: bl.TransformerBlock(D, H, key=k), 2, key=KEY)


def test_stack_is_named_per_block_like_a_module_list(stack):
    sd = bl.state_dict(stack)
    assert set(sd) == {f"blocks.{i}.{k}" for i in range(2) for k in TORCH_KEYS_MODERN}
    # block by block, as a ModuleList's state_dict lists them
    n = len(TORCH_KEYS_MODERN)
    assert [int(k.split(".")[1]) for k in sd] == [i for i in range(2) for _ in range(n)]
    np.testing.assert_array_equal(
        sd["blocks.1.attention.W_v.weight"], stack.blocks.attention.W_v.weight[1]
    )


@pytest.mark.float64  # a NumPy float64 reference at 1e-10
def test_stack_loads_each_block_from_its_own_keys(stack):
    rng = np.random.default_rng(3)
    per_block = [ref.random_state_dict(rng, D, dtype=np.float64) for _ in range(2)]
    sd = {f"blocks.{i}.{k}": v for i, b in enumerate(per_block) for k, v in b.items()}
    stack = bl.load_state_dict(stack, sd, dtype=jnp.float64)
    x = rng.normal(size=(T, D))
    h = x
    for b in per_block:
        h = ref.block(b, h, H, norm_kind="rms", act="swiglu", placement="pre",
                      valid_lens=np.arange(1, T + 1))  # fmt: skip
    np.testing.assert_allclose(
        stack(jnp.asarray(x), jnp.arange(1, T + 1)), h, rtol=1e-10
    )


def test_load_into_an_abstract_module_allocates_only_the_given_arrays():
    sd = _torch_like("2017")
    shell = eqx.filter_eval_shape(
        lambda: bl.TransformerBlock(D, H, key=KEY, **CHAPTER["2017"])
    )
    assert isinstance(shell.attention.W_q.weight, jax.ShapeDtypeStruct)
    assert set(bl.interop.porting.param_shapes(shell)) == TORCH_KEYS_2017
    blk = bl.load_state_dict(shell, sd)
    concrete = bl.load_state_dict(
        bl.TransformerBlock(D, H, key=KEY, **CHAPTER["2017"]), sd
    )
    x = jnp.ones((T, D))
    np.testing.assert_array_equal(blk(x), concrete(x))


@pytest.mark.float64  # a NumPy float64 reference at 1e-10
def test_chapter_char_lm_ports_after_renaming_blks():
    # The chapter's PyTorch CharLM: token_emb, pos_emb, blks.<i>.*, norm (head
    # tied to token_emb). Ours keeps its blocks in `stack`: rename the prefix.
    V, N = 11, 2
    rng = np.random.default_rng(4)
    torch_sd = {
        "token_emb.weight": rng.normal(0, 0.5, (V, D)),
        "pos_emb.weight": rng.normal(0, 0.5, (T, D)),
        "norm.weight": 1 + rng.normal(0, 0.2, D),
    }
    for i in range(N):
        for k, v in ref.random_state_dict(rng, D, dtype=np.float64).items():
            torch_sd[f"blks.{i}.{k}"] = v
    sd = {k.replace("blks.", "stack.blocks.", 1): v for k, v in torch_sd.items()}
    lm = bl.CharLM(V, num_hiddens=D, num_heads=H, num_blks=N, max_len=T, key=KEY)
    assert set(bl.state_dict(lm)) == set(sd)
    lm = bl.load_state_dict(lm, sd, dtype=jnp.float64)
    tokens = np.array([3, 1, 4, 1, 5, 9])
    h = torch_sd["token_emb.weight"][tokens] + torch_sd["pos_emb.weight"][:T]
    for i in range(N):
        blk = {k[len(f"blks.{i}.") :]: v for k, v in torch_sd.items()
               if k.startswith(f"blks.{i}.")}  # fmt: skip
        h = ref.block(blk, h, H, norm_kind="rms", act="swiglu", placement="pre",
                      valid_lens=np.arange(1, T + 1))  # fmt: skip
    want = ref.rms_norm(h, torch_sd["norm.weight"]) @ torch_sd["token_emb.weight"].T
    np.testing.assert_allclose(lm(jnp.asarray(tokens)), want, rtol=1e-10, atol=1e-10)
