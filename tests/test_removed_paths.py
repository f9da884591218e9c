"""What 0.3 removed and 0.4 moved fails plainly: the flat layout's module paths
raise `ImportError`, its top-level names `AttributeError`, and the renamed
keywords and options `TypeError` (Python's own, for an unexpected keyword) or a
CLI usage error (exit status 2); 0.4's moved modules raise `ImportError` at
their old paths. Nothing warns and then works (CHANGELOG.md, 0.3.0 and 0.4.0).
"""

import importlib
import json

import numpy as np
import pytest

import blocklab as bl

#: The module paths of the flat layout (0.1), relative to `blocklab`; 0.2 kept
#: them as deprecated views of their layer modules, 0.3 removed them.
OLD_MODULES = (
    "attention", "block", "census", "checkpoint", "commands", "commands.census",
    "commands.check", "commands.launch", "commands.lr_sweep", "commands.norms",
    "commands.signal", "commands.train", "decoder", "distributed", "ffn",
    "functional", "identities", "init", "inplace", "launcher", "moe",
    "norms", "plotting", "porting", "report", "sharding", "signal", "sweep",
    "theory", "timing", "train",
)  # fmt: skip

#: Top-level names of 0.1 that left the curated namespace in 0.2 (deprecated
#: there) and were removed in 0.3; they live in their layer modules.
OLD_NAMES = (
    "ACTS", "AttentionTrace", "BlockTrace", "GATED_ACTS", "Identity", "LMBatches",
    "LaunchError", "LaunchResult", "MoEStats", "MoETrace", "NORMS", "PLACEMENTS",
    "PRECISIONS", "SignalStats", "TrainState", "TrainStep", "attention_entropy",
    "check_seeds", "collapse_spread", "ffn_width", "gelu", "gelu_exact",
    "gelu_second_moment", "init_state", "linear", "llama_ffn_width",
    "load_balancing_loss", "masked_softmax", "member_mesh", "moe_forward",
    "moe_loss", "next_token_loss", "pad_members", "qk_logit_bound", "relu",
    "rope_frequencies", "signal_run", "silu", "stack_moe_stats", "step_keys",
    "sweep_optimizer", "token_spread", "validation_loss",
)  # fmt: skip


def test_the_lists_are_the_ones_the_changelog_counts():
    # `blocklab.models` was a flat module of 0.1; it is the models layer since 0.4
    assert len(set(OLD_MODULES)) == len(OLD_MODULES) == 31
    assert len(set(OLD_NAMES)) == len(OLD_NAMES) == 43


def test_the_changelog_lists_every_removal_under_this_version():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    release = text.split("## [0.3.0]", 1)[1].split("\n## [", 1)[0]
    removed = release.split("### Removed", 1)[1]
    for old in OLD_MODULES:
        assert f"`blocklab.{old}`" in removed, old
    for name in OLD_NAMES:
        assert f"`{name}`" in removed, name
    for keyword in ("num_steps=", "num_blocks=", "seeds=", "--num-steps", "--seeds"):
        assert keyword in removed, keyword


#: 0.4's moves (the house, step 4): old path -> new home.
MOVED_04 = {
    "blocklab.nn.charlm": "blocklab.models.charlm",
    "blocklab.nn.decoder": "blocklab.models.decoder",
    "blocklab.nn.decoder_config": "blocklab.models.decoder_config",
    "blocklab.nn.encoder": "blocklab.models.encoder",
    "blocklab.nn.encoder_config": "blocklab.models.encoder_config",
    "blocklab.nn.encoder_decoder": "blocklab.models.encoder_decoder",
    "blocklab.nn.moe_decoder": "blocklab.models.moe_decoder",
    "blocklab.nn.generation": "blocklab.models.generation",
    "blocklab.nn.cache": "blocklab.models.decoding",
    "blocklab.interop.text": "blocklab.text.generation",
    "blocklab.interop.streaming": "blocklab.text.streaming",
    "blocklab.interop.evaluate": "blocklab.text.evaluate",
    "blocklab.interop.lm_eval": "blocklab.text.lm_eval",
    "blocklab.interop.tokenizer": "blocklab.data.tokenizer",
    "blocklab.experiments.plan": "blocklab.training.plan",
}


@pytest.mark.parametrize("old", MOVED_04)
def test_a_moved_module_fails_at_its_old_path_and_loads_at_its_new_one(old):
    with pytest.raises(ImportError, match=f"No module named '{old}'"):
        importlib.import_module(old)
    assert importlib.import_module(MOVED_04[old]).__name__ == MOVED_04[old]


def test_the_changelog_lists_each_move_with_its_new_home():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "CHANGELOG.md").read_text()
    release = text.split("## [0.4.0]", 1)[1].split("\n## [", 1)[0]
    moved = release.split("### Moved", 1)[1].split("\n### ", 1)[0]
    for old, new in MOVED_04.items():
        assert f"`{old}` -> `{new}`" in moved, old


@pytest.mark.parametrize(
    "name",
    ["CharLM", "DecoderLM", "DecoderConfig", "EncoderModel", "EncoderDecoderLM",
     "MoEDecoderConfig", "generate"],
)  # fmt: skip
def test_models_left_the_layers_namespace(name):
    import blocklab.models
    import blocklab.nn

    assert not hasattr(blocklab.nn, name)
    home = getattr(blocklab.models, name)
    assert getattr(bl, name, home) is home


@pytest.mark.parametrize("old", OLD_MODULES)
def test_an_old_module_path_is_an_import_error(old):
    parent = old.split(".")[0]  # `blocklab.commands.train` fails at `commands`
    with pytest.raises(ImportError, match=f"No module named 'blocklab.{parent}"):
        importlib.import_module(f"blocklab.{old}")


@pytest.mark.parametrize(
    "statement",
    [
        "import blocklab.attention",
        "import blocklab.train",
        "from blocklab.models import Stack",
        "from blocklab.commands import lr_sweep",
        "import blocklab.commands.lr_sweep",
        "from blocklab import attention",
        "from blocklab import GATED_ACTS",
        "import blocklab._compat",
    ],
)
def test_old_import_statements_fail_with_import_error(statement):
    with pytest.raises(ImportError):
        exec(statement, {})


@pytest.mark.parametrize("name", OLD_NAMES)
def test_an_old_top_level_name_is_an_attribute_error(name):
    if name in bl.__all__:
        pytest.skip(f"{name} is exported again, from its new home")
    with pytest.raises(AttributeError, match=f"has no attribute '{name}'"):
        getattr(bl, name)


@pytest.mark.parametrize("old", [m for m in OLD_MODULES if "." not in m])
def test_an_old_module_is_not_an_attribute_either(old):
    if old in bl.__all__:  # `bl.census` is the counting function
        pytest.skip(f"{old} is a current name")
    with pytest.raises(AttributeError):
        getattr(bl, old)


def test_representative_old_names_fail_whatever_is_exported():
    for name in ("GATED_ACTS", "attention_entropy", "gelu", "TrainState"):
        assert not hasattr(bl, name), name
        with pytest.raises(AttributeError):
            getattr(bl, name)
    # the lazy layer packages and their one entry point still load
    assert bl.experiments.__name__ == "blocklab.experiments"
    assert callable(bl.coord_check)


def test_the_renamed_keyword_helper_is_gone():
    import blocklab._validate as v

    assert not hasattr(v, "renamed_keyword")
    assert "renamed_keyword" not in v.__all__


# ------------------------------------------------------------ old keywords
def _text():
    return "abcabcabcabcabcabcabcabc"


OLD_KEYWORDS = {
    # num_steps= (a sequence length that read like optimizer steps) -> seq_len=
    "TimeMachine(num_steps=)": lambda: bl.TimeMachine(num_steps=5),
    "TokenDataset(num_steps=)": lambda: bl.TokenDataset(np.arange(40) % 7, num_steps=5),
    "TokenDataset.from_text(num_steps=)": lambda: bl.TokenDataset.from_text(
        _text(), num_steps=5
    ),
    # num_blocks= -> num_blks= (the chapter's name)
    "collapse_spread(num_blocks=)": lambda: _theory().collapse_spread(
        num_blocks=8, alpha=1.0, num_tokens=64
    ),
    "post_ln_identity_factor(num_blocks=)": lambda: _theory().post_ln_identity_factor(
        0.5, num_blocks=12
    ),
    # seeds= as a count -> num_seeds= (`seeds` lists seeds)
    "signal_propagation(seeds=)": lambda: _signal().signal_propagation(
        ("pre",), seeds=2
    ),
    "signal_arch(seeds=)": lambda: _signal().signal_arch("chapter", seeds=2),
    "run_exercises(seeds=)": lambda: _signal().run_exercises(["4"], seeds=2),
    "run_check(seeds=)": lambda: _check().run_check(seeds=2),
}


def _theory():
    from blocklab.diagnostics import theory

    return theory


def _signal():
    from blocklab.experiments import signal

    return signal


def _check():
    from blocklab.experiments import check

    return check


@pytest.mark.parametrize("call", OLD_KEYWORDS.values(), ids=OLD_KEYWORDS.keys())
def test_an_old_keyword_is_a_type_error(call):
    """Refused when the call binds its arguments: before any work (Python names
    the unexpected keyword, or the required new one that is missing)."""
    with pytest.raises(TypeError, match="unexpected keyword|missing .*num_blks"):
        call()


def test_the_resolved_sizes_with_a_trailing_underscore_are_gone():
    """`DecoderConfig.kv_heads_` / `.head_dim_` (0.2, deprecated) are
    `cfg.block.num_kv_heads` / `.head_dim`: a trailing underscore means in place."""
    cfg = bl.DecoderConfig.llama(
        vocab_size=32, num_hiddens=48, num_heads=6, num_kv_heads=None, num_blks=1,
        max_len=16,
    )  # fmt: skip
    # hand-worked: no kv heads given -> K = H = 6; p = d / H = 48 / 6 = 8
    assert (cfg.block.num_kv_heads, cfg.block.head_dim) == (6, 8)
    for old in ("kv_heads_", "head_dim_"):
        with pytest.raises(AttributeError, match=old):
            getattr(cfg, old)


def test_a_count_given_as_seeds_to_signal_sweep_is_refused():
    """`signal_sweep(placement, seeds)` takes **options, so a number in `seeds`
    is refused by name (a `ConfigError`, which is also a `TypeError`)."""
    import inspect

    from blocklab.diagnostics import propagation

    signal_sweep = inspect.unwrap(propagation.signal_sweep)  # past the type hook
    with pytest.raises(bl.ConfigError, match=r"got the number 3; .*num_seeds=S"):
        signal_sweep("pre", 3)
    with pytest.raises(TypeError):
        propagation.signal_sweep("pre", 3)


def test_the_datasets_have_no_num_steps_attribute():
    data = bl.TokenDataset.from_text(_text(), 4)
    assert data.seq_len == 4
    with pytest.raises(AttributeError):
        data.num_steps  # noqa: B018


# ------------------------------------------------------------- old CLI options
@pytest.mark.parametrize(
    "argv, option",
    [
        (["signal", "--seeds", "2"], "--seeds"),
        (["check", "--seeds", "3"], "--seeds"),
        (["activations", "--num-steps", "8"], "--num-steps"),
    ],
)
def test_an_old_cli_option_is_a_usage_error(argv, option, capsys, monkeypatch):
    from blocklab.cli import app

    def no_work(args):
        raise AssertionError("the command ran")

    monkeypatch.setattr(app, "check_outputs", no_work)
    assert app.main([*argv, "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    assert option in out["error"], out
