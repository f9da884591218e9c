"""Interoperation with other libraries (imported lazily: no torch at import time)."""

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
from .mixtral import MoEDecoderConfig  # registers the "mixtral" family

__all__ = [
    "FAMILIES",
    "HFFamily",
    "MoEDecoderConfig",
    "Rule",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "register_family",
    "to_huggingface_state_dict",
]
