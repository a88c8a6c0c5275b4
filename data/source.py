"""What `data.path` names, opened as prepared shards: a directory made by `python -m data.prepare`,
or a glob of text files ('' = the embedded standard-library corpus), which is prepared on first use
into the run's cache (`WORKDIR/data/<key>`, the key a hash of the glob, the tokenizer and the
split) and read from there afterwards."""
import hashlib
import json
import os

from data.corpus import list_files
from data.prepare import open_tokenizer, prepare
from data.shards import PreparedData


def is_prepared_path(path: str) -> bool:
  """A directory (of prepared shards), as opposed to a glob of text files."""
  return bool(path) and os.path.isdir(os.path.expanduser(path))


def check_path(path: str, tokenizer_spec: str) -> None:
  """DataError in one line for a data.path that names nothing readable (nothing is written)."""
  if is_prepared_path(path):
    PreparedData(os.path.expanduser(path)).check_tokenizer(open_tokenizer(tokenizer_spec))
  else:
    list_files(path)


def cache_directory(cache_root: str, path: str, tokenizer_spec: str, val_fraction: float) -> str:
  identity = {'input': path, 'tokenizer': open_tokenizer(tokenizer_spec).identity(),
              'val_fraction': val_fraction}
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
  return os.path.join(cache_root, key)


def open_data(path: str, tokenizer_spec: str, val_fraction: float, cache_root: str,
              prepare_here: bool = True, progress: bool = True) -> PreparedData:
  """The prepared data `data.path` names, checked against `tokenizer_spec`. A glob is prepared into
  `cache_root` when `prepare_here` (one process of a run prepares; the others read what it wrote,
  or, with no shared file system, prepare their own copy)."""
  tokenizer = open_tokenizer(tokenizer_spec)
  if is_prepared_path(path):
    prepared = PreparedData(os.path.expanduser(path))
  else:
    directory = cache_directory(cache_root, path, tokenizer_spec, val_fraction)
    if prepare_here or not os.path.isfile(os.path.join(directory, 'index.json')):
      prepare(path, tokenizer_spec, directory, val_fraction=val_fraction, progress=progress,
              rebuild_stale=True)
    prepared = PreparedData(directory)
  prepared.check_tokenizer(tokenizer)
  return prepared
