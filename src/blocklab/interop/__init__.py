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

__all__ = [
    "FAMILIES",
    "HFFamily",
    "Rule",
    "from_huggingface",
    "hf_config_to_decoder",
    "load_huggingface_state_dict",
    "register_family",
    "to_huggingface_state_dict",
]
