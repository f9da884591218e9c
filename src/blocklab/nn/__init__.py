"""Layer 1, the model: pure array functions and the Equinox modules built on them.

`functional` (norms, activations, RoPE, masked softmax), `normalization`,
`config` (`BlockConfig`, the block's options, declared and checked once),
`inplace` (donating norms), `attention` (+ `attention_impls`), `cache`,
`ffn`, `moe`, `block`, `stack` (+ `remat`, its policies), `charlm`,
`decoder_config` and `decoder` (real architectures), `encoder_config`,
`encoder` and `encoder_decoder` (BERT, ModernBERT, ViT, T5, Whisper),
`relative_position`, `patch_embed`, `audio_embed`, `moe_decoder`,
`generation`, `lora` and `init` (re-initialization). It imports only the
shared checks below it.
"""

from .attention import AttentionTrace, MultiHeadAttention, with_attention_impl
from .block import PLACEMENTS, BlockTrace, TransformerBlock
from .charlm import CharLM
from .config import BlockConfig
from .decoder import DecoderLM
from .decoder_config import DecoderConfig
from .encoder import EncoderModel
from .encoder_config import EncoderConfig, EncoderDecoderConfig
from .encoder_decoder import EncoderDecoderLM
from .ffn import ACTS, GATED_ACTS, FeedForward, ffn_width
from .generation import generate
from .inplace import layer_norm_, rms_norm_
from .moe import MoEFeedForward, MoEStats, MoETrace
from .moe_decoder import MoEDecoderConfig
from .normalization import NORMS, LayerNorm, RMSNorm
from .remat import with_remat
from .stack import Stack

__all__ = [
    "ACTS",
    "AttentionTrace",
    "BlockConfig",
    "BlockTrace",
    "CharLM",
    "DecoderConfig",
    "DecoderLM",
    "EncoderConfig",
    "EncoderDecoderConfig",
    "EncoderDecoderLM",
    "EncoderModel",
    "FeedForward",
    "GATED_ACTS",
    "LayerNorm",
    "MoEDecoderConfig",
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
    "with_remat",
]
