"""Data the examples train on, available on every machine without a download."""
from offload.data.stdlib_corpus import (
    VOCAB_SIZE,
    BatchSampler,
    StdlibSourcesNotFound,
    load_corpus,
    split_corpus,
    stdlib_files,
    stdlib_path,
)

__all__ = ["VOCAB_SIZE", "BatchSampler", "StdlibSourcesNotFound", "load_corpus", "split_corpus",
           "stdlib_files", "stdlib_path"]
