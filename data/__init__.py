"""Data: the byte tokenizer, corpus files and their split, and the packed batch streams."""

from data.corpus import DataError, Shard, list_files, load_tokens, split_files
from data.pipeline import TokenBatches, eval_batches
from data.tokenizer import ByteTokenizer

__all__ = ["ByteTokenizer", "DataError", "Shard", "TokenBatches", "eval_batches", "list_files",
           "load_tokens", "split_files"]
