"""Interoperation: Hugging Face families, PyTorch state dicts, checkpoint folders.

Every `transformers` family is one module of `interop.families` (the
decoders `gpt2`, `llama`, `mistral`, `qwen2`, `qwen3`, `olmo2`, `gemma2`,
`gemma3`, `phi3`, `mixtral`; the encoders and encoder–decoders `bert`,
`modernbert`, `vit`, `t5` for T5 / mT5 / umT5, `whisper`), each a `Family`
built on the public helpers of `hf_common` and registered in the one
`FAMILIES` when the package imports it; `huggingface` is the conversion
machinery (`from_huggingface`, the state dicts); `porting` maps PyTorch
state dicts; `pretrained` reads and writes checkpoint folders (config.json +
safetensors, through `safetensors_io`) without torch; `peft` reads and writes
PEFT adapter folders. torch and transformers are imported lazily, only when a
torch model is passed. Text in, text out is one layer up (`blocklab.text`);
a folder's tokenizer is data (`blocklab.data.load_tokenizer`).
"""

from .hf_common import StoredAs
from .huggingface import (
    FAMILIES,
    Family,
    Rule,
    from_huggingface,
    hf_config_to_decoder,
    load_huggingface_state_dict,
    register_family,
    to_huggingface_state_dict,
)
from .porting import load_state_dict, state_dict
from .pretrained import (
    config_of,
    load_pretrained,
    pretrained_config,
    read_config,
    save_pretrained,
)

__all__ = [
    "FAMILIES",
    "Family",
    "Rule",
    "StoredAs",
    "config_of",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "load_pretrained",
    "load_state_dict",
    "pretrained_config",
    "read_config",
    "register_family",
    "save_pretrained",
    "state_dict",
    "to_huggingface_state_dict",
]
