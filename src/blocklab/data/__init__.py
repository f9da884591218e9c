"""The data: the shipped corpus, the tokenizers, token datasets.

Pure NumPy / JAX token handling with no model in it: the character vocabulary
(`VOCAB`, `encode`, `decode`) and a checkpoint folder's BPE tokenizer
(`tokenizer`: `load_tokenizer`), token datasets, packing and token files.
`data` and `nn` are independent (neither imports the other);
`blocklab.text.generate_text` joins a model and a tokenizer.
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
from .tokenizer import Tokenizer, load_tokenizer

__all__ = [
    "VOCAB",
    "TimeMachine",
    "TokenDataset",
    "TokenFile",
    "TokenPipeline",
    "Tokenizer",
    "corpus_path",
    "decode",
    "encode",
    "load_tokenizer",
    "pack_documents",
    "preprocess",
    "tokenize_files",
]
