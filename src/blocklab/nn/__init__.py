"""The layers: pure array functions and the Equinox modules built on them.

`functional` (norms, activations, RoPE, masked softmax), `normalization`,
`config` (`BlockConfig`, the block's options, declared and checked once),
`inplace` (donating norms), `attention` (+ `mask`, the one mask value,
`attention_impls`, its kernels, and `kv_cache`, one layer's cache), `ffn`,
`moe`, `block`, `stack` (+ `remat`, its policies), `relative_position`,
`patch_embed`, `audio_embed`, `parametrization` (standard and muP), `lora` and
`init` (re-initialization). Whole models are one
layer up, in `blocklab.models`. It imports only the shared checks below it.
"""

from .attention import AttentionTrace, MultiHeadAttention, with_attention_impl
from .block import PLACEMENTS, BlockTrace, TransformerBlock
from .config import BlockConfig
from .ffn import ACTS, GATED_ACTS, FeedForward, ffn_width
from .inplace import layer_norm_, rms_norm_
from .mask import Mask
from .moe import MoEFeedForward, MoEStats, MoETrace
from .normalization import NORMS, LayerNorm, RMSNorm
from .remat import with_remat
from .stack import Stack

__all__ = [
    "ACTS",
    "AttentionTrace",
    "BlockConfig",
    "BlockTrace",
    "FeedForward",
    "GATED_ACTS",
    "LayerNorm",
    "Mask",
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
    "layer_norm_",
    "rms_norm_",
    "with_attention_impl",
    "with_remat",
]
