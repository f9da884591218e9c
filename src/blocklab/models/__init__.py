"""Whole models, each config beside its model, and decoding.

`decoder_config` and `decoder` (`DecoderLM`: the real decoder architectures),
`moe_decoder` (`MoEDecoderConfig`), `charlm` (`CharLM`: the chapter's
character model), `encoder_config`, `encoder` (`EncoderModel`: BERT,
ModernBERT, ViT) and `encoder_decoder` (`EncoderDecoderLM`: T5, Whisper);
`decoding` (a whole model's cache, prefill, the decode step), `decode_loop`
(the one decoding loop, `GenerationConfig`, sampling) and `generation`
(`generate`: every model that decodes, through that loop). Built from the
layers in `blocklab.nn`.
"""

from .charlm import CharLM
from .decode_loop import GenerationConfig
from .decoder import DecoderLM
from .decoder_config import DecoderConfig
from .encoder import EncoderModel
from .encoder_config import EncoderConfig, EncoderDecoderConfig
from .encoder_decoder import EncoderDecoderLM
from .generation import generate
from .moe_decoder import MoEDecoderConfig

__all__ = [
    "CharLM",
    "DecoderConfig",
    "DecoderLM",
    "EncoderConfig",
    "EncoderDecoderConfig",
    "EncoderDecoderLM",
    "EncoderModel",
    "GenerationConfig",
    "MoEDecoderConfig",
    "generate",
]
