"""Layer 0, the data: the shipped corpus, its character vocabulary, token datasets.

Pure NumPy / JAX token handling with no model in it. `data` and `nn` are
independent (neither imports the other); `blocklab.generate_text` joins a
model and a tokenizer such as `VOCAB` one layer up.
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
from .pipeline import TokenFile, TokenPipeline, tokenize_files

__all__ = [
    "VOCAB",
    "TimeMachine",
    "TokenDataset",
    "TokenFile",
    "TokenPipeline",
    "corpus_path",
    "decode",
    "encode",
    "pack_documents",
    "preprocess",
    "tokenize_files",
]
