"""What `data.path` names, opened as prepared shards: a directory made by `python -m data.prepare`,
or a glob of input files ('' = the embedded standard-library corpus), which is prepared on first
use into the run's cache (`WORKDIR/data/<key>`, the key a hash of the glob, the tokenizer, the
split and how documents are read: `data.text_field`, `data.document_delimiter`) and read from
there afterwards; or a mixture of several such sources with weights (data/mixture.py).

Stale data is not read silently. Each time a glob is opened, the process that prepares
(`prepare_here`: the main one) fingerprints the inputs again (their content, not their times;
data/prepare.py) and compares them with the cache's plan: on a change the cache, ours, is prepared
again after one line naming the first changed file and whether its size or its content changed.
How much of the inputs a start reads is `data.verify_inputs`: 'sampled' (the default) checks every
size and the sampled fingerprints of a spread of 64 inputs (data/files.py), so a start costs a
bounded read whatever the corpus's size, and misses a same-size change outside what it samples;
'full' reads every byte, as `python -m data.prepare` always does. Shards are checked the same way
as they are opened (data/shards.py).
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

from typing import NamedTuple

from data import mixture
from data.corpus import DataError, list_files
from data.files import VERIFY, VERIFY_MODES
from data.prepare import changed_input, open_tokenizer, prepare, prepared_already
from data.records import BadRecords, Reading, parse_delimiter
from data.shards import PreparedData


class SourceKey(NamedTuple):
  """What decides a source's prepared shards: the config's `data` section, in a hashable form."""
  path: str
  tokenizer: str
  val_fraction: float
  reading: Reading = Reading()
  on_bad_record: str = 'fail'


def source_key(data, path: str | None = None) -> SourceKey:
  """The key of a config's `data` section (`path`: one source of a mixture instead of its path)."""
  return SourceKey(data.path if path is None else path, data.tokenizer, data.val_fraction,
                   Reading(data.get('text_field', 'text'),
                           parse_delimiter(data.get('document_delimiter', ''))),
                   data.get('on_bad_record', 'fail'))


def is_prepared_path(path: str) -> bool:
  """A directory (of prepared shards), as opposed to a glob of text files."""
  return bool(path) and os.path.isdir(os.path.expanduser(path))


def check_data(data) -> None:
  """DataError in one line for a config's `data` section that names nothing readable, or reads it
  in a way that is not allowed (nothing is written)."""
  key = source_key(data)
  if data.get('verify_inputs', VERIFY) not in VERIFY_MODES:
    raise DataError(f'data.verify_inputs={data.verify_inputs!r}; allowed: {", ".join(VERIFY_MODES)}')
  key.reading.check()
  BadRecords(key.on_bad_record)
  for source in sources_of(data.path):
    if is_prepared_path(source.path):
      PreparedData(os.path.expanduser(source.path)).check_tokenizer(open_tokenizer(data.tokenizer))
    else:
      list_files(source.path)


def sources_of(path: str) -> list[mixture.Component]:
  """The sources `data.path` names: a mixture's, or itself as the one source (named '')."""
  return mixture.parse(path) or [mixture.Component('', 1.0, path)]


def cache_directory(cache_root: str, key: SourceKey) -> str:
  """Where a run caches a glob's preparation. (`on_bad_record` is not part of the hash: it decides
  whether a preparation finishes, not what it holds.)"""
  identity = {'input': key.path, 'tokenizer': open_tokenizer(key.tokenizer).identity(),
              'val_fraction': key.val_fraction}
  if key.reading != Reading():   # (so that the caches of whole text files keep their keys)
    identity['reading'] = key.reading._asdict()
  key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
  return os.path.join(cache_root, key)


def check_inputs(prepared: PreparedData, verify: str = VERIFY) -> None:
  """DataError in one line when an input `prepared` records is readable here and has changed
  (`verify`: as data.verify_inputs says)."""
  changed = (changed_input(prepared.index['inputs'], verify) if 'inputs' in prepared.index
             else None)
  if changed:
    raise DataError(f'data.path={prepared.directory!r} was prepared from inputs that have changed '
                    f'since ({changed}); run python -m data.prepare again, into a new --out or '
                    'after deleting this one')


def open_data(key: SourceKey, cache_root: str, prepare_here: bool = True,
              progress: bool = True, verify: str = VERIFY) -> PreparedData:
  """The prepared data of one source, checked against its tokenizer and, as `verify`
  (data.verify_inputs) says, against its inputs and shards. A glob is prepared into `cache_root`
  when `prepare_here` (one process of a run prepares; the others read what it wrote, or, with no
  shared file system, prepare their own copy); a finished cache whose inputs pass the sampled
  check is taken as it is, else `prepare` checks them whole and prepares again what changed."""
  tokenizer = open_tokenizer(key.tokenizer)
  if is_prepared_path(key.path):
    prepared = PreparedData(os.path.expanduser(key.path), verify)
    check_inputs(prepared, verify)
  else:
    directory = cache_directory(cache_root, key)
    if prepare_here or not os.path.isfile(os.path.join(directory, 'index.json')):
      if not (verify == 'sampled' and prepared_already(
          key.path, key.tokenizer, directory, val_fraction=key.val_fraction, reading=key.reading)):
        prepare(key.path, key.tokenizer, directory, val_fraction=key.val_fraction,
                progress=progress, rebuild_stale=True, reading=key.reading,
                on_bad_record=key.on_bad_record)
    prepared = PreparedData(directory, verify)
  prepared.check_tokenizer(tokenizer)
  return prepared


def open_sources(data, cache_root: str, prepare_here: bool = True,
                 progress: bool = True) -> list[tuple[str, float, PreparedData]]:
  """(name, weight, prepared data) of every source a config's `data` section names: one, named
  '' with weight 1, or a mixture's."""
  return [(source.name, source.weight,
           open_data(source_key(data, source.path), cache_root, prepare_here, progress,
                     data.get('verify_inputs', VERIFY)))
          for source in sources_of(data.path)]
