"""What `data.path` names, opened as prepared shards: a directory made by `python -m data.prepare`,
or a glob of text files ('' = the embedded standard-library corpus), which is prepared on first use
into the run's cache (`WORKDIR/data/<key>`, the key a hash of the glob, the tokenizer and the
split) and read from there afterwards.

Stale data is never read silently. Each time a glob is opened, the process that prepares
(`prepare_here`: the main one) fingerprints the inputs again (their content, not their times;
data/prepare.py) and compares them with the cache's plan: on a change the cache, ours, is prepared
again after one line naming the first changed file and whether its size or its content changed.
The other processes of a run read the cache it has just checked, without hashing again. A
directory given as `data.path` is checked by every process against the inputs its index records,
those readable here (inputs absent here are accepted: the directory may have been prepared
elsewhere): a changed one is a DataError naming it, since the directory is the user's to prepare
again. A directory whose index records no inputs (prepared before they were recorded) opens
unverified; a cache whose plan records no fingerprints is prepared again.
"""
import hashlib
import json
import os

from data.corpus import DataError, list_files
from data.prepare import changed_input, open_tokenizer, prepare
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


def check_inputs(prepared: PreparedData) -> None:
  """DataError in one line when an input `prepared` records is readable here and has changed."""
  changed = changed_input(prepared.index['inputs']) if 'inputs' in prepared.index else None
  if changed:
    raise DataError(f'data.path={prepared.directory!r} was prepared from inputs that have changed '
                    f'since ({changed}); run python -m data.prepare again, into a new --out or '
                    'after deleting this one')


def open_data(path: str, tokenizer_spec: str, val_fraction: float, cache_root: str,
              prepare_here: bool = True, progress: bool = True) -> PreparedData:
  """The prepared data `data.path` names, checked against `tokenizer_spec`. A glob is prepared into
  `cache_root` when `prepare_here` (one process of a run prepares; the others read what it wrote,
  or, with no shared file system, prepare their own copy)."""
  tokenizer = open_tokenizer(tokenizer_spec)
  if is_prepared_path(path):
    prepared = PreparedData(os.path.expanduser(path))
    check_inputs(prepared)
  else:
    directory = cache_directory(cache_root, path, tokenizer_spec, val_fraction)
    if prepare_here or not os.path.isfile(os.path.join(directory, 'index.json')):
      prepare(path, tokenizer_spec, directory, val_fraction=val_fraction, progress=progress,
              rebuild_stale=True)
    prepared = PreparedData(directory)
  prepared.check_tokenizer(tokenizer)
  return prepared
