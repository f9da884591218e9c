"""Layer 1, the model: pure array functions and the Equinox modules built on them.

`functional` (norms, activations, RoPE, masked softmax), `normalization`,
`config` (`BlockConfig`, the block's options, checked once),
`inplace` (donating norms), `attention`, `ffn`, `moe`, `block`, `stack`,
`charlm`, `decoder` (real architectures) and `init` (re-initialization). It
imports only `blocklab.data` (the character vocabulary) and the shared
checks below it.
"""

from .attention import AttentionTrace, MultiHeadAttention, with_attention_impl
from .block import PLACEMENTS, BlockTrace, TransformerBlock
from .charlm import CharLM
from .config import BlockConfig
from .decoder import DecoderConfig, DecoderLM
from .ffn import ACTS, GATED_ACTS, FeedForward, ffn_width
from .generation import generate
from .inplace import layer_norm_, rms_norm_
from .moe import MoEFeedForward, MoEStats, MoETrace
from .normalization import NORMS, LayerNorm, RMSNorm
from .stack import Stack

__all__ = [
    "ACTS",
    "AttentionTrace",
    "BlockConfig",
    "BlockTrace",
    "CharLM",
    "DecoderConfig",
    "DecoderLM",
    "FeedForward",
    "GATED_ACTS",
    "LayerNorm",
    "MoEFeedForward",
    "MoEStats",
    "MoETrace",
    "MultiHeadAttention",
    "NORMS",
    "PLACEMENTS",
    "RMSNorm",
    "Stack",
    "TransformerBlock",
    "ffn_width",
    "generate",
    "layer_norm_",
    "rms_norm_",
    "with_attention_impl",
]
