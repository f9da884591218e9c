"""BlockConfig: checked once where it is built, trusted below, counted exactly."""

import dataclasses
import inspect
import itertools
import subprocess
import sys
import textwrap

import equinox as eqx
import jax
import numpy as np
import pytest

from blocklab import ConfigError
from blocklab.diagnostics.counting import census, count_params
from blocklab.diagnostics.theory import block_param_count
from blocklab.models import DecoderConfig
from blocklab.models.charlm import CharLM
from blocklab.nn import config
from blocklab.nn.attention import MultiHeadAttention
from blocklab.nn.block import TransformerBlock
from blocklab.nn.config import BlockConfig
from blocklab.nn.ffn import FeedForward

KEY = jax.random.key(0)


def _abstract_block(cfg):
    return eqx.filter_eval_shape(TransformerBlock, cfg, key=KEY)


# ------------------------------------------------------------- checked once
def test_a_block_checks_its_options_once_in_the_config(monkeypatch):
    post_init = BlockConfig.__post_init__
    built = []

    def counting_post_init(self):
        built.append(self)
        post_init(self)

    monkeypatch.setattr(BlockConfig, "__post_init__", counting_post_init)
    blk = TransformerBlock(
        24, 4, num_kv_heads=2, qk_norm="full", rope_theta=1e4, act="geglu", key=KEY
    )
    assert len(built) == 1 and blk.cfg is built[0]

    # A config built beforehand is not checked again, by any module.
    TransformerBlock(blk.cfg, key=KEY)
    MultiHeadAttention(blk.cfg, key=KEY)
    FeedForward(blk.cfg, key=KEY)
    assert len(built) == 1
    # The keyword spelling of each module builds one config.
    MultiHeadAttention(24, 4, key=KEY)
    FeedForward(24, "gelu", key=KEY)
    assert len(built) == 3


def test_an_invalid_config_cannot_reach_a_block(plain_python):
    cfg = BlockConfig(16, 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.norm = "batch"
    with pytest.raises(ConfigError, match=r"BlockConfig: norm must be one of"):
        dataclasses.replace(cfg, norm="batch")
    with pytest.raises(ConfigError, match=r"TransformerBlock: .* got norm='layer'"):
        TransformerBlock(cfg, norm="layer", key=KEY)
    with pytest.raises(ConfigError, match=r"got num_heads=4 beside it"):
        TransformerBlock(cfg, 4, key=KEY)
    with pytest.raises(ConfigError, match=r"MultiHeadAttention: .* got attn_scale=0.5"):
        MultiHeadAttention(cfg, attn_scale=0.5, key=KEY)
    with pytest.raises(ConfigError, match=r"FeedForward: .* got act='gelu'"):
        FeedForward(cfg, "gelu", key=KEY)
    for module in (TransformerBlock, MultiHeadAttention):
        with pytest.raises(TypeError, match=r"unknown option 'scale'.*attn_scale"):
            module(16, 4, scale=0.5, key=KEY)


REFUSALS = [
    (dict(num_hiddens=0), r"num_hiddens must be a positive int, got 0"),
    (dict(num_heads=True), r"num_heads must be an int, got True"),
    (dict(num_heads=5), r"num_hiddens must be divisible by num_heads, .*head_dim"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\), got dropout=1.0"),
    (dict(norm="RMS"), r"norm must be one of \['gemma_rms', 'layer', 'rms'\], got"),
    (dict(act="swish"), r"act must be one of \['relu', .*\], got act='swish'"),
    (dict(placement="middle"), r"placement must be one of \['post', .*'middle'"),
    (dict(bias="no"), r"bias must be a bool \(True or False\), got 'no'"),
    (dict(qk_norm="yes"), r"qk_norm must be one of \[False, True, 'head', 'full'\]"),
    (dict(norm_eps=-1.0), r"norm_eps must lie in \[0.0, inf\], got -1.0"),
    (dict(num_kv_heads=3), r"num_kv_heads must divide num_heads, got num_kv_heads=3"),
    (dict(head_dim=0), r"head_dim must lie in \[1, inf\], got 0"),
    (dict(ffn_width=2.5), r"ffn_width must be an int, got 2.5"),
    (dict(attn_scale=0.0), r"attn_scale must lie in \(0.0, inf\], got 0.0"),
    (dict(rope_theta=float("inf")), r"rope_theta must be finite, got inf"),
    (dict(rope_theta=1e4, head_dim=3), r"RoPE needs an even head_dim, got head_dim=3"),
    (dict(window=-1), r"window must lie in \[0, inf\], got -1"),
    (dict(attn_bias=1), r"attn_bias must be a bool"),
    (dict(ffn_bias=None, bias=0), r"bias must be a bool"),
]


@pytest.mark.parametrize(("change", "pattern"), REFUSALS)
def test_every_refusal_names_the_field_and_the_value(change, pattern, plain_python):
    options = {"num_hiddens": 16, "num_heads": 4, **change}
    with pytest.raises(ConfigError, match=r"^BlockConfig: " + pattern):
        BlockConfig(**options)
    with pytest.raises(ValueError, match=pattern):  # the keyword API, same check
        TransformerBlock(**options, key=KEY)


def test_no_module_lists_the_options_again():
    """The modules take a config or its fields as **options: no option is a
    parameter of theirs, so none has a second default or a second check."""
    fields = {f.name for f in dataclasses.fields(BlockConfig)} - {
        "num_hiddens", "num_heads", "act"
    }  # fmt: skip
    for module in (TransformerBlock, MultiHeadAttention, FeedForward):
        params = inspect.signature(module.__init__).parameters
        assert not fields & set(params), module
        assert params["options"].kind is inspect.Parameter.VAR_KEYWORD
    decoder = {f.name for f in dataclasses.fields(DecoderConfig)}
    assert not fields & decoder and "block" in decoder


# ------------------------------------------------------------- resolved values
@pytest.mark.parametrize("d", [1, 2, 3, 7, 64, 100, 4096])
def test_the_derived_sizes_are_resolved(d):
    gated, plain = BlockConfig(d, 1, act="swiglu"), BlockConfig(d, 1, act="relu")
    # round(8d/3) in integers: 8d/3 is never a tie (remainder 0, 1/3 or 2/3).
    assert gated.ffn_width == (8 * d + 1) // 3 and plain.ffn_width == 4 * d
    assert gated.head_dim == d and gated.num_kv_heads == 1
    assert gated.attn_bias is gated.ffn_bias is False
    assert gated.scale == pytest.approx(d**-0.5, rel=1e-15)


def test_equal_configs_are_the_blocks_that_are_the_same(plain_python):
    a = BlockConfig(64, 4, bias=True, qk_norm=True)
    b = BlockConfig(
        np.int64(64), 4, num_kv_heads=4, head_dim=16, ffn_width=171, qk_norm="head",
        attn_bias=True, ffn_bias=True, bias=True,
    )  # fmt: skip
    assert a == b and hash(a) == hash(b) and type(b.num_hiddens) is int
    assert BlockConfig(**a.to_dict()) == a
    assert a != BlockConfig(64, 4, bias=True)
    # head_dim=None derives it anew from the new sizes
    wider = dataclasses.replace(a, num_hiddens=128, head_dim=None, ffn_width=None)
    assert wider.head_dim == 32 and wider.ffn_width == (8 * 128 + 1) // 3


def test_the_block_stores_its_config_and_rebuilds_identically():
    cfg = BlockConfig(32, 4, norm="layer", placement="sandwich", bias=True, window=3)
    by_keywords = TransformerBlock(
        32, 4, norm="layer", placement="sandwich", bias=True, window=3, key=KEY
    )
    by_config = TransformerBlock(cfg, key=KEY)
    assert by_keywords.cfg == by_config.cfg == cfg
    assert by_config.placement == "sandwich" and by_config.num_hiddens == 32
    leaves_a = jax.tree_util.tree_leaves(by_keywords)
    leaves_b = jax.tree_util.tree_leaves(by_config)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b, strict=True):
        np.testing.assert_array_equal(x, y)
    assert count_params(cfg) == count_params(by_config)
    assert census(cfg) == census(by_config)
    assert "cfg" not in census(by_config)


def test_window_and_rope_theta_are_data_not_structure():
    a = TransformerBlock(16, 2, rope_theta=1e4, window=2, key=KEY)
    b = TransformerBlock(16, 2, rope_theta=1e6, window=0, key=KEY)
    structure = jax.tree_util.tree_structure
    assert a.cfg == b.cfg and structure(a) == structure(b)
    assert int(a.attention.window) == 2 and int(b.attention.window) == 0
    assert structure(TransformerBlock(16, 2, key=KEY)) != structure(a)


# ------------------------------------------------------------- exact counts
def _grid(n=48, seed=20261130):
    """Configurations drawn at random (not chosen to pass), every option mixed."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        H = int(rng.choice([1, 2, 3, 4, 6, 8]))
        K = int(rng.choice([k for k in (1, 2, 3, 4, 6, 8) if H % k == 0]))
        explicit_p = bool(rng.integers(2))
        d = (
            int(rng.choice([12, 24, 40, 48, 96]))
            if not explicit_p
            else int(rng.integers(5, 70))
        )
        if not explicit_p and d % H:
            d = H * int(rng.integers(1, 16))
        opts = dict(
            num_kv_heads=K,
            act=str(rng.choice(config.ACTS)),
            norm=str(rng.choice(["rms", "layer", "gemma_rms"])),
            placement=str(rng.choice(config.PLACEMENTS)),
            qk_norm=[False, True, "head", "full"][int(rng.integers(4))],
            bias=bool(rng.integers(2)),
        )
        if explicit_p:
            opts["head_dim"] = int(rng.integers(1, 20))
        if rng.integers(3) == 0:
            opts["ffn_width"] = int(rng.integers(1, 300))
        for name in ("attn_bias", "ffn_bias"):
            if rng.integers(3) == 0:
                opts[name] = bool(rng.integers(2))
        out.append(BlockConfig(d, H, **opts))
    return out


GRID = _grid()


def test_the_grid_covers_every_option():
    assert {c.act for c in GRID} == set(config.ACTS)
    assert {c.qk_norm for c in GRID} == {False, "head", "full"}
    assert {c.placement for c in GRID} == set(config.PLACEMENTS)
    assert any(c.num_kv_heads < c.num_heads for c in GRID)
    assert any(c.head_dim * c.num_heads != c.num_hiddens for c in GRID)
    assert any(c.attn_bias != c.ffn_bias for c in GRID)


@pytest.mark.parametrize("cfg", GRID, ids=lambda c: f"d{c.num_hiddens}H{c.num_heads}")
def test_block_param_count_of_a_config_counts_the_built_block(cfg):
    built = count_params(_abstract_block(cfg))
    assert block_param_count(cfg) == built
    kwargs = dataclasses.asdict(cfg)
    d, H = kwargs.pop("num_hiddens"), kwargs.pop("num_heads")
    assert block_param_count(d, H, **kwargs) == built  # the keyword form


def test_block_param_count_takes_a_config_alone():
    with pytest.raises(ConfigError, match=r"give a BlockConfig alone"):
        block_param_count(BlockConfig(16, 4), 4)


# ------------------------------------------------------------- the models
def test_decoder_config_block_builds_its_layers():
    cfg = DecoderConfig.gemma3(num_blks=3)
    blk = cfg.block
    assert isinstance(blk, BlockConfig)
    assert (blk.placement, blk.norm, blk.act, blk.qk_norm) == (
        "sandwich", "gemma_rms", "geglu", "head"
    )  # fmt: skip
    assert blk.head_dim == 16 and blk.num_kv_heads == 2 and blk.window == 16
    from blocklab.models.decoder import DecoderLM

    model = eqx.filter_eval_shape(DecoderLM, cfg, key=KEY)
    assert model.stack.blocks.cfg == blk
    assert count_params(model.stack) == 3 * block_param_count(blk)
    with pytest.raises(ConfigError, match=r"^BlockConfig: act must be one of"):
        DecoderConfig(64, 32, 4, 2, act="tanh")


def test_charlm_blocks_share_one_config():
    model = eqx.filter_eval_shape(
        CharLM, 28, 32, 4, 2, key=KEY, norm="layer", placement="post", bias=True
    )
    assert model.block == BlockConfig(
        32, 4, norm="layer", placement="post", bias=True
    )  # fmt: skip
    assert model.stack.blocks.cfg == model.block
    assert count_params(model.stack) == 2 * block_param_count(model.block)


def test_the_keyword_grid_of_the_old_api_still_matches():
    """The old keyword form over a small product of options (every combination)."""
    for act, qk, placement in itertools.product(
        ("gelu", "reglu"), (False, "full"), ("post", "sandwich")
    ):
        opts = dict(act=act, qk_norm=qk, placement=placement, num_kv_heads=2)
        built = count_params(
            eqx.filter_eval_shape(TransformerBlock, 40, 4, key=KEY, **opts)
        )
        assert block_param_count(40, 4, **opts) == built


# ------------------------------------------------------------- one declaration
#: A valid value, other than the default, for every field of BlockConfig
#: (d = 16, H = 4). A new field without an entry here fails
#: `test_every_field_has_a_probe`, so the reachability test covers it.
PROBES = {
    "num_hiddens": 24,
    "num_heads": 2,
    "dropout": 0.25,
    "norm": "layer",
    "act": "geglu",
    "placement": "sandwich",
    "bias": True,
    "qk_norm": "full",
    "norm_eps": 1e-3,
    "num_kv_heads": 2,
    "head_dim": 6,
    "ffn_width": 20,
    "attn_scale": 0.3,
    "rope_theta": 500.0,
    "window": 3,
    "attn_bias": True,
    "ffn_bias": True,
    "attn_out_bias": True,
    "attn_softcap": 7.0,
    "attention_impl": "chunked",
    "window_mode": "bidirectional",
    "cross_attention": True,
    "skip_attn_norm": True,
}


def test_every_field_has_a_probe():
    assert set(PROBES) == {f.name for f in dataclasses.fields(BlockConfig)}


def _leaf_values(tree):
    return [np.asarray(x) for x in jax.tree_util.tree_leaves(tree)]


def _same_module(a, b):
    structure = jax.tree_util.tree_structure
    assert structure(a) == structure(b)
    for x, y in zip(_leaf_values(a), _leaf_values(b), strict=True):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("name", sorted(PROBES))
def test_every_option_reaches_every_module_with_one_meaning(name, plain_python):
    """Each field of BlockConfig, set by each construction path, builds the
    same config and the same weights: the keyword spelling of the block, of
    the attention and of the FFN, the block of a DecoderConfig (both its
    spellings), the decoder's read-through, its built stack, and CharLM."""
    d, H = 16, 4
    option = {name: PROBES[name]}
    sizes = {"num_hiddens": d, "num_heads": H, **option}
    cfg = BlockConfig(**sizes)
    assert getattr(cfg, name) == getattr(BlockConfig(**sizes), name)
    by_keywords = TransformerBlock(**sizes, key=KEY)
    by_config = TransformerBlock(cfg, key=KEY)
    assert by_keywords.cfg == cfg and by_config.cfg == cfg
    _same_module(by_keywords, by_config)  # window/rope_theta leaves included

    attn_key, ffn_key = jax.random.split(KEY)
    _same_module(MultiHeadAttention(**sizes, key=attn_key), by_config.attention)
    _same_module(MultiHeadAttention(cfg, key=attn_key), by_config.attention)
    _same_module(FeedForward(cfg, key=ffn_key), by_config.ffn)

    # A decoder: learned positions, so that the block is exactly `cfg` (with
    # RoPE the decoder supplies its default base); a RoPE probe needs "rope".
    positions = "rope" if name == "rope_theta" else "learned"
    dec = DecoderConfig(50, num_blks=2, positions=positions, **sizes)
    assert dec.block == cfg and getattr(dec, name) == getattr(cfg, name)
    assert DecoderConfig(50, num_blks=2, positions=positions, block=cfg) == dec
    assert DecoderConfig(**dec.to_dict()) == dec
    assert dataclasses.replace(dec, **option).block == cfg
    from blocklab.models import DecoderLM

    model = eqx.filter_eval_shape(DecoderLM, dec, key=KEY)
    assert model.stack.blocks.cfg == cfg
    want = eqx.filter_eval_shape(TransformerBlock, cfg, key=KEY)
    shapes = [(x.shape[1:], x.dtype) for x in jax.tree.leaves(model.stack.blocks)]
    assert shapes == [(x.shape, x.dtype) for x in jax.tree.leaves(want)]
    if name in ("rope_theta", "window"):  # data: the value is in the leaves
        attn = DecoderLM(dec, key=KEY).stack.blocks.attention
        want = by_config.attention
        np.testing.assert_array_equal(getattr(attn, name)[0], getattr(want, name))

    if name not in ("num_hiddens", "num_heads", "act"):
        lm = eqx.filter_eval_shape(CharLM, 28, d, H, 1, key=KEY, **option)
        assert lm.block == cfg


SCRATCH = """
import dataclasses, jax, equinox as eqx
import blocklab as bl
from blocklab import ConfigError
from blocklab.models import DecoderConfig, DecoderLM, MoEDecoderConfig
assert bl.__file__.startswith(ROOT), bl.__file__
k = jax.random.key(0)
blk = bl.TransformerBlock(16, 4, scratch_option=3, key=k)
assert blk.cfg.scratch_option == 3
assert bl.MultiHeadAttention(16, 4, scratch_option=5, key=k) is not None
for cls in (DecoderConfig, MoEDecoderConfig):
    cfg = cls(50, 16, 4, 2, scratch_option=3)
    assert cfg.scratch_option == 3 and cfg.block.scratch_option == 3
    assert dataclasses.replace(cfg, scratch_option=4).scratch_option == 4
    model = DecoderLM(cfg, key=k)
    assert model.stack.blocks.cfg.scratch_option == 3
    again = DecoderLM(**model.init_args(), key=k)
    assert again.cfg == cfg and again.cfg.scratch_option == 3
lm = bl.CharLM(28, 16, 4, 1, scratch_option=2, key=k)
assert lm.stack.blocks.cfg.scratch_option == 2
try:
    bl.TransformerBlock(16, 4, scratch_option=-1, key=k)
except ConfigError as e:
    assert "scratch_option" in str(e), e
else:
    raise AssertionError("a bad scratch_option was accepted")
print("reached")
"""


def test_a_new_option_needs_one_edit(tmp_path):
    """Add a field (and its check) to a copy of BlockConfig, edit nothing
    else: the option reaches TransformerBlock, the attention, DecoderConfig
    (both configs), DecoderLM's stack, its saved config and CharLM."""
    import shutil

    import blocklab

    src = tmp_path / "blocklab"
    shutil.copytree(
        blocklab.__path__[0], src, ignore=shutil.ignore_patterns("__pycache__")
    )
    path = src / "nn" / "config.py"
    text = path.read_text()
    field = '    attention_impl: str = "auto"\n'
    check = "    @property\n    def gated(self)"
    assert text.count(field) == 1 and text.count(check) == 1
    text = text.replace(field, field + "    scratch_option: int = 0\n")
    text = text.replace(
        check,
        "    def _check_scratch(self):\n"
        '        value = check_int("BlockConfig", "scratch_option", '
        "self.scratch_option, min=0)\n"
        '        object.__setattr__(self, "scratch_option", value)\n\n' + check,
    )
    post = "    def __post_init__(self):\n"
    assert text.count(post) == 1
    text = text.replace(post, post + "        self._check_scratch()\n")
    path.write_text(text)
    code = f"ROOT = {str(src)!r}\n" + textwrap.dedent(SCRATCH)
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("reached")


def test_configs_that_build_different_structures_are_not_equal():
    """A config is a static (jit-cached) argument: whether a window or RoPE is
    present changes the module, so it changes `==` and `hash` (their values,
    per-layer data, do not for a block, and do for a decoder)."""
    assert BlockConfig(16, 2, window=3) == BlockConfig(16, 2, window=0)
    assert BlockConfig(16, 2, window=3) != BlockConfig(16, 2)
    assert BlockConfig(16, 2, rope_theta=1e4) != BlockConfig(16, 2)
    build = eqx.filter_jit(lambda cfg, key: TransformerBlock(cfg, key=key))
    with_window = build(BlockConfig(16, 2, window=3), KEY)
    assert with_window.attention.window is not None
    assert build(BlockConfig(16, 2), KEY).attention.window is None

    from blocklab.models import DecoderLM

    local, plain = DecoderConfig.llama(window=8), DecoderConfig.llama()
    assert local != plain and DecoderConfig.llama(window=4) != local
    assert DecoderLM(local, key=KEY).stack.blocks.attention.window is not None
    assert DecoderLM(plain, key=KEY).stack.blocks.attention.window is None
    wide = DecoderLM(DecoderConfig.llama(window=4), key=KEY)
    np.testing.assert_array_equal(wide.stack.blocks.attention.window, [4, 4])
