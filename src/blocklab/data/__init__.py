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
