"""Data: corpus files and their split, preparation into token shards, and the batches read from
them. The names below are imported on first use, so that `python -m data.prepare` and its worker
processes do not import grain (1.8 s and ~200 MB each) for batches they never make."""
import importlib

_WHERE = {
    'DataError': 'data.corpus', 'Shard': 'data.corpus', 'list_files': 'data.corpus',
    'split_files': 'data.corpus', 'TokenBatches': 'data.pipeline', 'eval_batches': 'data.pipeline',
    'eval_window_indices': 'data.pipeline', 'PreparedData': 'data.shards',
    'SplitShards': 'data.shards', 'IGNORED': 'data.windows', 'Windows': 'data.windows',
    'batch_keys': 'data.windows',
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
  if name not in _WHERE:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(importlib.import_module(_WHERE[name]), name)
