"""Reading a prepared directory (data/prepare.py): its index, and one split's shards, memory-mapped.

A shard is opened only when a window of it is first read, and checked then against what its index
records: by default (`verify='sampled'`) a spread of SAMPLED_FILES of the split's shards by their
sampled fingerprints (a read of at most 512 KiB a file whatever its size: data/files.py), the
others by their sizes alone; with `verify='full'` each by its sha256 (one sequential read of the
whole shard). A shard prepared before sampled fingerprints is checked whole. Its size is checked
for every shard when the directory is opened (no read). A process's private memory therefore does
not grow with the corpus; the pages of the shards it reads are the kernel's page cache, mapped into
it (counted in its RSS as file pages, shared and dropped under memory pressure: bench/data.py
measures both).
"""
import os

import numpy as np

from data.corpus import DataError
from data.files import (FORMAT, SPLITS, VERIFY, file_sha256, read_json, sampled_fingerprint,
                        spread)


class SplitShards:
  """The shards of one split, in order. `opened` lists the shard numbers this process has opened."""

  def __init__(self, directory: str, split: str, entries: list[dict], dtype: str,
               verify: str | None):
    self.directory, self.split, self._entries = directory, split, entries
    self.dtype = np.dtype(dtype)
    self.verify = verify
    self.tokens = np.asarray([e['tokens'] for e in entries], np.int64)
    self.documents = int(sum(e['documents'] for e in entries))
    self.bytes = int(sum(e['bytes'] for e in entries))
    self.opened: list[int] = []
    self._sampled = set(spread(list(range(len(entries)))))   # checked by content when sampled
    self._tokens: dict[int, np.ndarray] = {}
    self._docs: dict[int, np.ndarray] = {}
    for e in entries:   # a truncated or missing file is refused now, before anything else runs
      path = self._path(e, '.bin')
      size = os.path.getsize(path) if os.path.isfile(path) else None
      if size != e['tokens'] * self.dtype.itemsize:
        raise DataError(f'shard {path} has {size} bytes but its index says '
                        f'{e["tokens"] * self.dtype.itemsize}; prepare the data again')

  def __len__(self) -> int:
    return len(self._entries)

  def _path(self, entry: dict, suffix: str) -> str:
    return os.path.join(self.directory, entry['name'] + suffix)

  def _open(self, shard: int) -> None:
    entry = self._entries[shard]
    path = self._path(entry, '.bin')
    if self.verify and (self.verify == 'full' or shard in self._sampled or 'sample' not in entry):
      sampled = self.verify == 'sampled' and 'sample' in entry
      digest, what, keys = ((sampled_fingerprint, 'sampled fingerprint', ('sample', 'docs_sample'))
                            if sampled else (file_sha256, 'sha256', ('sha256', 'docs_sha256')))
      for suffix, key in zip(('.bin', '.docs.npy'), keys):
        if digest(self._path(entry, suffix)) != entry[key]:
          raise DataError(f'shard {self._path(entry, suffix)} does not match the {what} its index '
                          'records (changed or damaged since it was prepared); prepare the data again')
    self.opened.append(shard)
    self._tokens[shard] = (np.memmap(path, self.dtype, mode='r') if entry['tokens'] else
                           np.zeros(0, self.dtype))
    self._docs[shard] = np.load(self._path(entry, '.docs.npy'), mmap_mode='r')

  def shard_tokens(self, shard: int) -> np.ndarray:
    """Shard `shard`'s token ids, memory-mapped (opened on first use)."""
    if shard not in self._tokens:
      self._open(shard)
    return self._tokens[shard]

  def document_starts(self, shard: int) -> np.ndarray:
    """Where each of the shard's documents starts, in its tokens."""
    if shard not in self._docs:
      self._open(shard)
    return self._docs[shard]

  def document_lengths(self, shard: int) -> np.ndarray:
    """Each document's tokens (its markers included), from the document index alone: the shard's
    tokens are not opened."""
    entry = self._entries[shard]
    starts = np.load(self._path(entry, '.docs.npy'), mmap_mode='r')
    return np.diff(np.append(np.asarray(starts), entry['tokens']))


class PreparedData:
  """A prepared directory: the tokenizer it was made with, and its splits."""

  def __init__(self, directory: str, verify: str | None = VERIFY):
    self.directory = directory
    path = os.path.join(directory, 'index.json')
    if not os.path.isfile(path):
      detail = (' (an unfinished preparation: run the same python -m data.prepare again to finish it)'
                if os.path.isfile(os.path.join(directory, 'plan.json')) else '')
      raise DataError(f'data.path={directory!r} is a directory without index.json{detail}; give a '
                      "directory made by python -m data.prepare, or a glob of text files")
    self.index = read_json(path)
    if self.index.get('format') != FORMAT:
      raise DataError(f'{path} has format {self.index.get("format")!r}; this code reads format '
                      f'{FORMAT}: prepare the data again')
    self.tokenizer = self.index['tokenizer']
    self.verify = verify

  def check_tokenizer(self, tokenizer) -> None:
    """DataError unless `tokenizer` is the one the shards were made with."""
    made, given = self.tokenizer, tokenizer.identity()
    keys = ('name', 'vocab_size', 'sha256')
    if any(made[k] != given[k] for k in keys):
      describe = lambda t: f'{t["name"]} (vocabulary {t["vocab_size"]}, sha256 {t["sha256"][:12] or "-"})'
      raise DataError(f'data.path={self.directory!r} was prepared with the tokenizer '
                      f'{describe(made)}, but data.tokenizer gives {describe(given)}; use the same '
                      'tokenizer, or prepare the data again with this one')

  def split(self, name: str) -> SplitShards:
    if name not in SPLITS:
      raise ValueError(f'split {name!r}; allowed: {", ".join(SPLITS)}')
    entries = self.index['splits'][name]['shards']
    return SplitShards(self.directory, name, entries, self.index['dtype'], self.verify)

  def bytes_per_token(self, split: str = 'val') -> float:
    """Input bytes per predicted token: bits per byte = nats per token / ln 2 / this. One marker
    per document is never a target (the bos after an eos), so it is left out of the count."""
    s = self.index['splits'][split]
    return s['bytes'] / max(s['tokens'] - s['documents'], 1)
