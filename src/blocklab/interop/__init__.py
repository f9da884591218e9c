"""Layer 4, interoperation: Hugging Face families, PyTorch state dicts, and text.

`huggingface` is the conversion machinery; each of the 10 families (GPT-2,
Llama, Mistral, Qwen 2, Qwen 3, OLMo 2, Gemma 2, Gemma 3, Phi-3, Mixtral) is a
module (`gpt2`, `llama`, `mistral`, `qwen2`, `qwen3`, `olmo2`, `gemma2`,
`gemma3`, `phi3`, `mixtral`) built on the public helpers of `hf_common`;
`porting` maps PyTorch state dicts; `pretrained`
reads and writes checkpoint folders (config.json + safetensors, through
`safetensors_io`) without torch; `text` is text in, text out
(`generate_text`, through any tokenizer with `encode`/`decode`);
`tokenizer` reads a checkpoint folder's tokenizer (`load_tokenizer`). torch and
transformers are imported lazily, only when a torch model is passed.
"""

from .evaluate import EvalResult, TextScore, evaluate_text
from .hf_common import StoredAs
from .huggingface import (
    FAMILIES,
    HFFamily,
    Rule,
    from_huggingface,
    hf_config_to_decoder,
    load_huggingface_state_dict,
    register_family,
    to_huggingface_state_dict,
)
from .porting import load_state_dict, state_dict
from .pretrained import (
    load_pretrained,
    pretrained_config,
    read_config,
    save_pretrained,
)
from .streaming import IncrementalDecoder
from .text import TextStream, generate_text, stream_text
from .tokenizer import load_tokenizer

__all__ = [
    "EvalResult",
    "TextScore",
    "evaluate_text",
    "FAMILIES",
    "HFFamily",
    "IncrementalDecoder",
    "Rule",
    "StoredAs",
    "from_huggingface",
    "generate_text",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "load_pretrained",
    "load_state_dict",
    "load_tokenizer",
    "pretrained_config",
    "read_config",
    "register_family",
    "save_pretrained",
    "state_dict",
    "stream_text",
    "TextStream",
    "to_huggingface_state_dict",
]
