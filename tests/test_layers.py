"""The packages are the layers: imports point down (import-linter), and every
path of the old flat layout still imports, with a DeprecationWarning."""

import os
import shutil
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest

import blocklab as bl

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "blocklab"

#: `blocklab.__all__` of version 0.1 (the flat layout), every name of which
#: must still resolve as `bl.NAME`.
OLD_ALL = (
    "ACTS AttentionTrace BlockTrace CharLM DecoderConfig DecoderLM FeedForward "
    "GATED_ACTS Identity LMBatches LaunchError LaunchResult LayerNorm "
    "MoEFeedForward MoEStats MoETrace MultiHeadAttention NORMS PLACEMENTS "
    "PRECISIONS RMSNorm SignalStats Stack SweepResult TimeMachine TokenDataset "
    "TrainResult TrainState TrainStep TransformerBlock attention_entropy "
    "block_param_count census chapter_stack check_seeds collapse_spread "
    "count_params distributed experiments ffn_width from_huggingface functional "
    "gelu gelu_exact gelu_second_moment generate identities init init_state "
    "inplace launch_local layer_norm layer_norm_ linear llama_ffn_width lm_loss "
    "load load_balancing_loss load_huggingface_state_dict load_state_dict "
    "make_train_step masked_softmax member_mesh moe_forward moe_loss "
    "next_token_loss pad_members qk_logit_bound relu rms_norm rms_norm_ rope "
    "rope_frequencies save sharded_map signal_run signal_stats signal_sweep silu "
    "stack_moe_stats state_dict step_keys sweep_grid sweep_optimizer theory "
    "to_huggingface_state_dict token_spread train_lm train_model train_sweep "
    "validation_loss"
).split()

#: Modules of the flat layout and one name each must still provide.
OLD_MODULES = {
    "attention": "MultiHeadAttention",
    "block": "TransformerBlock",
    "census": "census",
    "checkpoint": "save",
    "commands": "COMMANDS",
    "commands.train": "run",
    "decoder": "DecoderLM",
    "distributed": "initialize",
    "ffn": "FeedForward",
    "functional": "rms_norm",
    "identities": "Identity",
    "init": "xavier_uniform",
    "inplace": "rms_norm_",
    "launcher": "launch_local",
    "models": "CharLM",
    "moe": "MoEFeedForward",
    "norms": "RMSNorm",
    "plotting": "line_plot",
    "porting": "state_dict",
    "report": "write_report",
    "sharding": "sharded_map",
    "signal": "signal_stats",
    "sweep": "train_sweep",
    "theory": "block_param_count",
    "timing": "time_call",
    "train": "train_model",
}


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install -e '.[dev]')")
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [exe, "--no-cache"], cwd=cwd, env=env, capture_output=True, text=True
    )


def test_the_layer_contract_is_kept():
    out = _lint(ROOT, ROOT / "src")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "1 kept, 0 broken" in out.stdout


@pytest.mark.parametrize(
    ("module", "line"),
    [
        ("nn/ffn.py", "from ..training import step as _up"),
        ("data/datasets.py", "from ..nn import stack as _up"),
        ("diagnostics/theory.py", "from ..interop import porting as _up"),
        ("nn/block.py", "def _f():\n    from ..experiments import plotting"),
    ],
)
def test_an_upward_import_breaks_the_contract(tmp_path, module, line):
    """The check can fail: a copy of the package with one import pointing up."""
    shutil.copytree(SRC, tmp_path / "src" / "blocklab")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / "src" / "blocklab" / module
    target.write_text(target.read_text() + "\n" + line + "\n")
    out = _lint(tmp_path, tmp_path / "src")
    assert out.returncode != 0
    assert "BROKEN" in out.stdout or "broken" in out.stdout


@pytest.mark.parametrize("name", OLD_ALL)
def test_every_old_top_level_name_still_resolves(name):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        assert getattr(bl, name) is not None


def test_the_curated_surface_is_sorted_by_group_and_about_half_the_old_one():
    # Of the 0.1 names, about half stay on top; the features added since
    # (generation, checkpoint folders, meshes, muP) add their one entry point each.
    kept = [name for name in bl.__all__ if name in OLD_ALL]
    assert len(kept) <= len(OLD_ALL) // 2 + 5
    assert len(bl.__all__) <= 60
    assert len(set(bl.__all__)) == len(bl.__all__)
    for name in bl.__all__:
        assert not isinstance(getattr(bl, name), type(sys)), f"{name} is a module"


def test_a_moved_name_warns_and_is_the_new_object():
    from blocklab.nn.functional import gelu

    with pytest.warns(DeprecationWarning, match=r"blocklab\.nn\.functional\.gelu"):
        assert bl.gelu is gelu


def test_a_misspelled_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'TransformerBlok'"):
        bl.TransformerBlok  # noqa: B018


def test_old_module_paths_import_in_a_fresh_interpreter_with_a_warning():
    checks = "\n".join(
        f"import blocklab.{mod} as m; assert hasattr(m, {name!r}), {mod!r}"
        for mod, name in OLD_MODULES.items()
    )
    code = textwrap.dedent(
        """
        import warnings
        warnings.simplefilter("always", DeprecationWarning)
        with warnings.catch_warnings(record=True) as caught:
        {checks}
            from blocklab.models import Stack
            from blocklab.commands import train
        moved = [str(w.message) for w in caught if "moved to" in str(w.message)]
        assert any("blocklab.attention moved to blocklab.nn.attention" in m
                   for m in moved), moved
        assert any("blocklab.train moved to blocklab.training.train" in m
                   for m in moved), moved
        print(len(moved))
        """
    ).format(checks=textwrap.indent(checks, "    "))
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= len(OLD_MODULES)


def test_old_module_paths_are_views_of_the_new_modules():
    import blocklab.nn.charlm
    import blocklab.nn.stack

    sys.modules.pop("blocklab.models", None)
    with pytest.warns(DeprecationWarning, match="blocklab.models moved"):
        import blocklab.models as old  # noqa: F401
    assert old.Stack is blocklab.nn.stack.Stack
    assert old.CharLM is blocklab.nn.charlm.CharLM
