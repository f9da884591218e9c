"""The checkpoint families: one module each, registered in `FAMILIES` on import.

Every module of this package is imported here, in name order, by
`pkgutil.iter_modules`: a family is one file dropped in this folder, built on
the helpers of `interop.hf_common` and ending in a `register_family(...)`
call; nothing else names it. The decoders (`gpt2`, `llama`, `mistral`,
`qwen2`, `qwen3`, `olmo2`, `gemma2`, `gemma3`, `phi3`, `mixtral`) map a
`transformers` config onto a `DecoderConfig`; the encoders and
encoder–decoders (`bert`, `modernbert`, `vit`, `t5` for T5 / mT5 / umT5,
`whisper`) onto the config of an encoder or encoder–decoder model.
"""

import importlib
import pkgutil

__all__ = [m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")]

for _name in sorted(__all__):
    importlib.import_module(f"{__name__}.{_name}")
