"""blocklab: the transformer block in pure JAX.

Build it (`TransformerBlock`, `Stack`, `CharLM`), train it, diagnose it at
initialization, and check its mathematics numerically. Modules are Equinox
pytrees acting on one sequence `(T, d)`; batches and seeds come from
`jax.vmap`.
"""

from . import distributed, experiments, functional, identities, init, inplace, theory
from .attention import AttentionTrace, MultiHeadAttention
from .block import PLACEMENTS, BlockTrace, TransformerBlock
from .census import census, count_params
from .checkpoint import load, save
from .data import TimeMachine, TokenDataset
from .decoder import DecoderConfig, DecoderLM
from .ffn import ACTS, GATED_ACTS, FeedForward, ffn_width
from .functional import (
    attention_entropy,
    gelu,
    gelu_exact,
    layer_norm,
    linear,
    masked_softmax,
    relu,
    rms_norm,
    rope,
    rope_frequencies,
    silu,
    token_spread,
)
from .identities import Identity
from .inplace import layer_norm_, rms_norm_
from .interop import (
    from_huggingface,
    load_huggingface_state_dict,
    to_huggingface_state_dict,
)
from .launcher import LaunchError, LaunchResult, launch_local
from .models import CharLM, Stack, generate
from .moe import (
    MoEFeedForward,
    MoEStats,
    MoETrace,
    load_balancing_loss,
    moe_forward,
    moe_loss,
    stack_moe_stats,
)
from .norms import NORMS, LayerNorm, RMSNorm
from .porting import load_state_dict, state_dict
from .signal import SignalStats, chapter_stack, signal_run, signal_stats, signal_sweep
from .sweep import (
    SweepResult,
    check_seeds,
    member_mesh,
    pad_members,
    sharded_map,
    sweep_grid,
    sweep_optimizer,
    train_sweep,
)
from .theory import (
    block_param_count,
    collapse_spread,
    gelu_second_moment,
    llama_ffn_width,
    qk_logit_bound,
)
from .train import (
    PRECISIONS,
    LMBatches,
    TrainResult,
    TrainState,
    TrainStep,
    init_state,
    lm_loss,
    make_train_step,
    next_token_loss,
    step_keys,
    train_lm,
    train_model,
    validation_loss,
)

__version__ = "0.1.0"

__all__ = [
    "ACTS",
    "AttentionTrace",
    "BlockTrace",
    "CharLM",
    "DecoderConfig",
    "DecoderLM",
    "from_huggingface",
    "load_huggingface_state_dict",
    "to_huggingface_state_dict",
    "FeedForward",
    "GATED_ACTS",
    "LayerNorm",
    "MultiHeadAttention",
    "MoEFeedForward",
    "MoEStats",
    "MoETrace",
    "load_balancing_loss",
    "moe_forward",
    "moe_loss",
    "stack_moe_stats",
    "NORMS",
    "PLACEMENTS",
    "RMSNorm",
    "SignalStats",
    "Stack",
    "TimeMachine",
    "TrainResult",
    "TrainState",
    "TrainStep",
    "TransformerBlock",
    "attention_entropy",
    "census",
    "chapter_stack",
    "count_params",
    "ffn_width",
    "functional",
    "gelu",
    "gelu_exact",
    "generate",
    "init",
    "inplace",
    "init_state",
    "layer_norm",
    "layer_norm_",
    "linear",
    "lm_loss",
    "load",
    "load_state_dict",
    "make_train_step",
    "masked_softmax",
    "rope",
    "rope_frequencies",
    "relu",
    "rms_norm",
    "rms_norm_",
    "save",
    "signal_run",
    "signal_stats",
    "signal_sweep",
    "silu",
    "state_dict",
    "step_keys",
    "token_spread",
    "train_lm",
    "validation_loss",
    "SweepResult",
    "member_mesh",
    "pad_members",
    "sharded_map",
    "sweep_optimizer",
    "train_sweep",
    "TokenDataset",
    "LMBatches",
    "PRECISIONS",
    "next_token_loss",
    "train_model",
    "sweep_grid",
    "check_seeds",
    "distributed",
    "LaunchError",
    "LaunchResult",
    "launch_local",
    "Identity",
    "block_param_count",
    "collapse_spread",
    "gelu_second_moment",
    "identities",
    "llama_ffn_width",
    "qk_logit_bound",
    "theory",
    "experiments",
]
