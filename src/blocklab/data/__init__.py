"""Layer 0, the data: the shipped corpus, its character vocabulary, token datasets.

Pure NumPy / JAX token handling with no model in it, so it sits below `nn`
(`CharLM.generate` encodes and decodes text with its vocabulary).
"""

from .datasets import (
    VOCAB,
    TimeMachine,
    TokenDataset,
    corpus_path,
    decode,
    encode,
    pack_documents,
    preprocess,
)

__all__ = [
    "VOCAB",
    "TimeMachine",
    "TokenDataset",
    "corpus_path",
    "decode",
    "encode",
    "pack_documents",
    "preprocess",
]
