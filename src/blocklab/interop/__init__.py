"""Layer 4, interoperation: Hugging Face families and the chapter's PyTorch state dicts.

`huggingface` is the conversion machinery; each family is a module (`gpt2`,
`llama`, `olmo2`, `gemma3`, `mixtral`) built on the public helpers of
`hf_common`; `porting` maps the chapter's PyTorch state dicts. torch and
transformers are imported lazily, only when a torch model is passed.
"""

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
from .mixtral import MoEDecoderConfig
from .porting import load_state_dict, state_dict

__all__ = [
    "FAMILIES",
    "HFFamily",
    "MoEDecoderConfig",
    "Rule",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "load_state_dict",
    "register_family",
    "state_dict",
    "to_huggingface_state_dict",
]
