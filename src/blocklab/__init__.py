"""blocklab: the transformer block in pure JAX.

Build it (`TransformerBlock`, `Stack`, `CharLM`), train it, diagnose it at
initialization, and check its mathematics numerically. Modules are Equinox
pytrees acting on one sequence `(T, d)`; batches and seeds come from
`jax.vmap`.
"""

from . import functional, init
from .attention import AttentionTrace, MultiHeadAttention
from .block import PLACEMENTS, BlockTrace, TransformerBlock
from .census import census, count_params
from .ffn import ACTS, GATED_ACTS, FeedForward, ffn_width
from .functional import (
    attention_entropy,
    gelu,
    gelu_exact,
    layer_norm,
    masked_softmax,
    relu,
    rms_norm,
    silu,
    token_spread,
)
from .models import Stack
from .norms import NORMS, LayerNorm, RMSNorm
from .signal import SignalStats, chapter_stack, signal_run, signal_stats, signal_sweep

__version__ = "0.1.0"

__all__ = [
    "ACTS",
    "AttentionTrace",
    "BlockTrace",
    "FeedForward",
    "GATED_ACTS",
    "LayerNorm",
    "MultiHeadAttention",
    "NORMS",
    "PLACEMENTS",
    "RMSNorm",
    "SignalStats",
    "Stack",
    "TransformerBlock",
    "attention_entropy",
    "census",
    "chapter_stack",
    "count_params",
    "ffn_width",
    "functional",
    "gelu",
    "gelu_exact",
    "init",
    "layer_norm",
    "masked_softmax",
    "relu",
    "rms_norm",
    "signal_run",
    "signal_stats",
    "signal_sweep",
    "silu",
    "token_spread",
]
