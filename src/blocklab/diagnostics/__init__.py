"""Layer 3, diagnostics: signal propagation at initialization, the block's
identities computed both ways, closed-form theory, and the parameter census."""

from .counting import census, count_params
from .identities import Identity
from .propagation import (
    SignalStats,
    chapter_stack,
    signal_run,
    signal_stats,
    signal_sweep,
)
from .theory import (
    block_param_count,
    collapse_spread,
    gelu_second_moment,
    llama_ffn_width,
    qk_logit_bound,
)
from .trained import model_diagnostics

__all__ = [
    "Identity",
    "SignalStats",
    "block_param_count",
    "census",
    "chapter_stack",
    "collapse_spread",
    "count_params",
    "gelu_second_moment",
    "llama_ffn_width",
    "model_diagnostics",
    "qk_logit_bound",
    "signal_run",
    "signal_stats",
    "signal_sweep",
]
