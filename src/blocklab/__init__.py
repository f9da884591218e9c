"""blocklab: the transformer block in pure JAX.

Build it (`TransformerBlock`, `Stack`, `CharLM`, `DecoderLM`), train it,
diagnose it at initialization, and check its mathematics numerically. Modules
are Equinox pytrees acting on one sequence `(T, d)`; batches and seeds come
from `jax.vmap`.

The packages are the layers, bottom to top (imports point down only):
`data` / `nn`, `models`, `training`, `diagnostics` / `interop` / `interp`,
`text`, `experiments`, `cli`.
This namespace re-exports what most users call; everything else is imported
from its layer, e.g. `from blocklab.nn.functional import gelu`.
"""

from ._validate import ConfigError
from .data import TimeMachine, TokenDataset, load_tokenizer
from .diagnostics import (
    block_param_count,
    census,
    chapter_stack,
    count_params,
    signal_stats,
    signal_sweep,
)
from .interop import (
    from_huggingface,
    load_huggingface_state_dict,
    load_pretrained,
    load_state_dict,
    save_pretrained,
    state_dict,
    to_huggingface_state_dict,
)
from .interop.peft import load_adapter, save_adapter
from .interp import capture, intervene
from .models import (
    CharLM,
    DecoderConfig,
    DecoderLM,
    EncoderConfig,
    EncoderDecoderConfig,
    EncoderDecoderLM,
    EncoderModel,
    GenerationConfig,
    generate,
)
from .nn import (
    BlockConfig,
    FeedForward,
    LayerNorm,
    MoEFeedForward,
    MultiHeadAttention,
    RMSNorm,
    Stack,
    TransformerBlock,
    layer_norm_,
    rms_norm_,
    with_attention_impl,
    with_remat,
)
from .nn.functional import layer_norm, rms_norm, rope
from .nn.lora import LoRAConfig, lora, merge_lora, unmerge_lora
from .text import evaluate_text, generate_text, stream_text
from .training import (
    RunConfig,
    SweepConfig,
    SweepResult,
    TrainResult,
    host_source,
    launch_local,
    lm_loss,
    load,
    make_train_step,
    optimizer,
    save,
    shard,
    sharded_map,
    sweep_grid,
    train_lm,
    train_model,
    train_sweep,
)

__version__ = "0.4.0"

__all__ = [
    # errors
    "ConfigError",
    # modules (blocklab.nn)
    "BlockConfig",
    "CharLM",
    "DecoderConfig",
    "DecoderLM",
    "EncoderConfig",
    "EncoderDecoderConfig",
    "EncoderDecoderLM",
    "EncoderModel",
    "FeedForward",
    "LayerNorm",
    "MoEFeedForward",
    "MultiHeadAttention",
    "RMSNorm",
    "Stack",
    "TransformerBlock",
    "GenerationConfig",
    "generate",
    "with_attention_impl",
    "with_remat",
    # functions (blocklab.nn.functional, blocklab.nn.inplace)
    "layer_norm",
    "layer_norm_",
    "rms_norm",
    "rms_norm_",
    "rope",
    # data (blocklab.data)
    "TimeMachine",
    "TokenDataset",
    # training (blocklab.training)
    "RunConfig",
    "SweepConfig",
    "SweepResult",
    "TrainResult",
    "host_source",
    "launch_local",
    "lm_loss",
    "load",
    "make_train_step",
    "optimizer",
    "coord_check",
    "plan_step",
    "save",
    "shard",
    "sharded_map",
    "sweep_grid",
    "train_lm",
    "train_model",
    "train_sweep",
    # diagnostics (blocklab.diagnostics)
    "block_param_count",
    "census",
    "chapter_stack",
    "count_params",
    "signal_stats",
    "signal_sweep",
    # interop (blocklab.interop)
    "from_huggingface",
    "generate_text",
    "stream_text",
    "evaluate_text",
    "load_huggingface_state_dict",
    "load_pretrained",
    "load_state_dict",
    "load_tokenizer",
    "save_pretrained",
    "state_dict",
    "to_huggingface_state_dict",
    # adapters (blocklab.nn.lora, blocklab.interop.peft)
    "LoRAConfig",
    "lora",
    "merge_lora",
    "unmerge_lora",
    "save_adapter",
    "load_adapter",
    # looking inside (blocklab.interp)
    "capture",
    "intervene",
]

#: Layer packages imported on first use (`bl.experiments`, `bl.cli`).
_LAZY_PACKAGES = ("experiments", "cli")


#: Public functions of lazy packages, imported on first use.
_LAZY_NAMES = {"coord_check": "experiments.mup", "plan_step": "training.plan"}


def __getattr__(name: str):
    if name in _LAZY_PACKAGES:
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY_PACKAGES})
