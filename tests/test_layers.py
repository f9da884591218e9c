"""The packages are the layers: imports point down (import-linter), and the
top-level namespace is a curated re-export (the flat layout's paths are gone:
tests/test_removed_paths.py)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import blocklab as bl

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "blocklab"

#: `blocklab.__all__` of version 0.1 (the flat layout).
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


def _lint(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    exe = shutil.which("lint-imports")
    # A missing tool fails: the contract is part of what the suite proves.
    assert exe is not None, "import-linter is not installed (pip install -e '.[dev]')"
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


def _cycles(root: Path) -> list[tuple[str, str]]:
    """Pairs of modules (not packages) that reach each other by imports, in a
    fresh interpreter on `root` (grimp, which import-linter is built on)."""
    code = (
        "import grimp, json\n"
        "g = grimp.build_graph('blocklab')\n"
        "pairs = set()\n"
        "for m in g.modules:\n"
        "    for n in g.find_modules_directly_imported_by(m):\n"
        "        if g.chain_exists(importer=n, imported=m):\n"
        "            pairs.add(tuple(sorted((m, n))))\n"
        "print(json.dumps(sorted(pairs)))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [tuple(p) for p in json.loads(out.stdout)]


def test_no_module_imports_itself_back():
    """No import cycle between any two modules, inside a layer too (a
    function-level import counts: grimp reads every import statement)."""
    assert _cycles(ROOT / "src") == []


def test_a_cycle_inside_a_layer_is_found(tmp_path):
    shutil.copytree(SRC, tmp_path / "blocklab")
    target = tmp_path / "blocklab" / "nn" / "functional.py"
    target.write_text(
        target.read_text() + "\n\ndef _f():\n    from .block import TransformerBlock\n"
    )
    assert ("blocklab.nn.block", "blocklab.nn.functional") in _cycles(tmp_path)


def test_the_curated_surface_is_sorted_by_group_and_about_half_the_old_one():
    # Of the 0.1 names, about half stay on top; the features added since
    # (generation, checkpoint folders, meshes, muP) add their one entry point each;
    # encoders add their two models and configs, as the decoders have; a run's
    # options and an adapter's settings their configs (RunConfig, SweepConfig,
    # LoRAConfig).
    kept = [name for name in bl.__all__ if name in OLD_ALL]
    assert len(kept) <= len(OLD_ALL) // 2 + 5
    assert len(bl.__all__) <= 71
    assert len(set(bl.__all__)) == len(bl.__all__)
    for name in bl.__all__:
        assert not isinstance(getattr(bl, name), type(sys)), f"{name} is a module"


def test_a_misspelled_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'TransformerBlok'"):
        bl.TransformerBlok  # noqa: B018
