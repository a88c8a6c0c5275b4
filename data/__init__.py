"""Data: corpus files and their split, preparation into token shards, and the batches
read from them."""

from data.corpus import DataError, Shard, list_files, split_files
from data.pipeline import TokenBatches, eval_batches, eval_window_indices
from data.shards import PreparedData, SplitShards
from data.windows import IGNORED, Windows, batch_keys

__all__ = ["DataError", "IGNORED", "PreparedData", "Shard",
           "SplitShards", "TokenBatches", "Windows", "batch_keys", "eval_batches",
           "eval_window_indices", "list_files", "split_files"]
