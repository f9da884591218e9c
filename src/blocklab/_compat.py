"""Old import paths of the flat layout, kept working with a DeprecationWarning.

Until version 0.2 the modules sat flat in `blocklab/` (`blocklab.attention`,
`blocklab.train`, ...) and `blocklab` re-exported 91 names. The modules now
live in one package per layer, and `blocklab` exports a curated set. Every old
module path and every old top-level name still resolves, once, with a
warning that names its new home.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types
import warnings

#: Old module (relative to `blocklab`) -> its new module(s).
MOVED_MODULES: dict[str, tuple[str, ...]] = {
    "attention": ("blocklab.nn.attention",),
    "block": ("blocklab.nn.block",),
    "census": ("blocklab.diagnostics.counting",),
    "checkpoint": ("blocklab.training.checkpoint",),
    "commands": ("blocklab.cli.commands",),
    "decoder": ("blocklab.nn.decoder",),
    "distributed": ("blocklab.training.distributed",),
    "ffn": ("blocklab.nn.ffn",),
    "functional": ("blocklab.nn.functional",),
    "identities": ("blocklab.diagnostics.identities",),
    "init": ("blocklab.nn.init",),
    "inplace": ("blocklab.nn.inplace",),
    "launcher": ("blocklab.training.launcher",),
    "models": ("blocklab.nn.stack", "blocklab.nn.charlm"),
    "moe": ("blocklab.nn.moe",),
    "norms": ("blocklab.nn.normalization",),
    "plotting": ("blocklab.experiments.plotting",),
    "porting": ("blocklab.interop.porting",),
    "report": ("blocklab.cli.report",),
    "sharding": ("blocklab.training.sharding",),
    "signal": ("blocklab.diagnostics.propagation",),
    "sweep": ("blocklab.training.sweep",),
    "theory": ("blocklab.diagnostics.theory",),
    "timing": ("blocklab.experiments.timing",),
    "train": ("blocklab.training.train",),
}
for _old, _new in {
    "census": "census",
    "check": "check",
    "launch": "launch",
    "lr_sweep": "lr_sensitivity",
    "norms": "norms",
    "signal": "signal",
    "train": "activations",
}.items():
    MOVED_MODULES[f"commands.{_old}"] = (f"blocklab.cli.commands.{_new}",)

#: Old top-level names that left the curated `blocklab` namespace -> their module.
MOVED_NAMES: dict[str, str] = {
    **dict.fromkeys(("AttentionTrace",), "blocklab.nn.attention"),
    **dict.fromkeys(("BlockTrace", "PLACEMENTS"), "blocklab.nn.block"),
    **dict.fromkeys(("ACTS", "GATED_ACTS", "ffn_width"), "blocklab.nn.ffn"),
    **dict.fromkeys(
        (
            "attention_entropy",
            "gelu",
            "gelu_exact",
            "linear",
            "masked_softmax",
            "relu",
            "rope_frequencies",
            "silu",
            "token_spread",
        ),
        "blocklab.nn.functional",
    ),
    **dict.fromkeys(
        (
            "MoEStats",
            "MoETrace",
            "load_balancing_loss",
            "moe_forward",
            "moe_loss",
            "stack_moe_stats",
        ),
        "blocklab.nn.moe",
    ),
    "NORMS": "blocklab.nn.normalization",
    **dict.fromkeys(
        (
            "LMBatches",
            "PRECISIONS",
            "TrainState",
            "TrainStep",
            "init_state",
            "next_token_loss",
            "step_keys",
            "validation_loss",
        ),
        "blocklab.training.train",
    ),
    **dict.fromkeys(
        ("member_mesh", "pad_members", "check_seeds"), "blocklab.training.sharding"
    ),
    "sweep_optimizer": "blocklab.training.sweep",
    **dict.fromkeys(("LaunchError", "LaunchResult"), "blocklab.training.launcher"),
    **dict.fromkeys(("SignalStats", "signal_run"), "blocklab.diagnostics.propagation"),
    "Identity": "blocklab.diagnostics.identities",
    **dict.fromkeys(
        ("collapse_spread", "gelu_second_moment", "llama_ffn_width", "qk_logit_bound"),
        "blocklab.diagnostics.theory",
    ),
}


def _warn(old: str, new: str, stacklevel: int = 3) -> None:
    warnings.warn(
        f"{old} moved to {new}; the old path is deprecated and will be removed "
        "in blocklab 0.3",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def moved_attribute(name: str):
    """`blocklab.<name>` for a name that moved: warn, then return it."""
    if name in MOVED_MODULES and "." not in name:
        return importlib.import_module(f"blocklab.{name}")
    if name in MOVED_NAMES:
        module = MOVED_NAMES[name]
        _warn(f"blocklab.{name}", f"{module}.{name}", stacklevel=4)
        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module 'blocklab' has no attribute {name!r}")


class _OldPathFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `blocklab.<old>` as a view of its new module(s), with a warning."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith("blocklab.") and fullname[9:] in MOVED_MODULES:
            return importlib.util.spec_from_loader(fullname, self)
        return None

    def create_module(self, spec):
        return types.ModuleType(spec.name)

    def exec_module(self, module):
        targets = [
            importlib.import_module(t) for t in MOVED_MODULES[module.__name__[9:]]
        ]
        _warn(module.__name__, " and ".join(t.__name__ for t in targets))
        for target in reversed(targets):
            module.__dict__.update(
                {k: v for k, v in vars(target).items() if not k.startswith("__")}
            )
        module.__doc__ = (
            f"Deprecated alias of {', '.join(t.__name__ for t in targets)}."
        )
        if module.__name__ == "blocklab.commands":
            module.__path__ = []  # a package, so `blocklab.commands.train` imports


def install() -> None:
    if not any(isinstance(f, _OldPathFinder) for f in sys.meta_path):
        sys.meta_path.append(_OldPathFinder())
