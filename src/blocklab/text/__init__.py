"""Text in, text out: a model and a tokenizer together.

`generation` (`generate_text`, `stream_text`, `TextStream`), `streaming`
(`IncrementalDecoder`: text as it is decoded), `evaluate` (`evaluate_text`:
perplexity and bits per byte over a text) and `lm_eval` (the lm-eval harness
model type, `lm_eval --model blocklab`; imported only on demand). The
tokenizers themselves are data (`blocklab.data`).
"""

from .evaluate import EvalResult, TextScore, evaluate_text
from .generation import TextStream, generate_text, stream_text
from .streaming import IncrementalDecoder

__all__ = [
    "EvalResult",
    "IncrementalDecoder",
    "TextScore",
    "TextStream",
    "evaluate_text",
    "generate_text",
    "stream_text",
]
