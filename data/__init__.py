"""Data: the byte tokenizer (or a Hugging Face one), corpus files and their split, and the packed batch streams."""

from data.corpus import DataError, Shard, list_files, load_tokens, split_files
from data.pipeline import TokenBatches, eval_batches
from data.tokenizer import ByteTokenizer, HFTokenizer, make_tokenizer

__all__ = ["ByteTokenizer", "DataError", "HFTokenizer", "make_tokenizer", "Shard", "TokenBatches", "eval_batches", "list_files",
           "load_tokens", "split_files"]
