"""Preparing a corpus once: tokenized, memory-mapped shards plus an index.

  python -m data.prepare --input='corpus/**/*.txt' --tokenizer=bytes --out=prepared/ [--workers=N]
  python -m data.prepare --input='dump/*' --text_field=text --out=prepared/ [--on_bad_record=skip]
  python -m data.prepare ... --engine=ray [--ray_address=auto]   # the groups as Ray tasks

What a file holds is data/records.py's: a text file is one document (or, where the split falls
back to cutting every file, data/corpus.py, its train part and its validation part), and goes to
train or validation by the hash of its path; a JSON Lines or Parquet file, or a text file cut at
`--document_delimiter`, holds many, each sent to a side by the hash of its file and its place in
it. Files are grouped, in path order, into groups of about `--shard_mb` MiB of input (a larger
file makes a group of its own; an uncompressed JSON Lines file larger than that is cut into
byte ranges, each a group, and a Parquet file into ranges of its row groups; a compressed JSON
Lines file is read from its start, one group a file). One worker process (or Ray task,
`--engine=ray`) tokenizes one group, streaming (its memory is bounded whatever the size of a
file), into `train-NNNNN.bin` and `val-NNNNN.bin`: the token ids
as uint8, uint16 or uint32, the narrowest that holds the vocabulary (a preparation of an older
version in a wider type still reads), every document stored as [bos] + tokens + [eos]
(data/tokenizer.py). A bad record stops the preparation (`--on_bad_record=fail`, one line naming
file, line and reason; the group's files are removed, nothing is recorded as done) or is skipped
and counted per reason in its group's record and the index (`skip`).
Beside each `.bin`, `.docs.npy` holds the offset of every document in it; `group-NNNNN.json`
records the fingerprints of the group's inputs and, for every shard it wrote, its tokens,
documents, input bytes and the sha256 of its two files. `index.json`, written last, names the
tokenizer and every shard, and records every input's size and fingerprint (`inputs`);
`data.path=DIR` trains on it.

Inputs are fingerprinted by content (BLAKE2b, with the size), never by modification time: an input
rewritten with other bytes of the same length, its mtime kept, must not pass for the one prepared.
Hashing is one read of the inputs (the embedded 31.5 MB corpus: ~0.07 s warm on one CPU core).

Resumable and idempotent: `plan.json` fixes the groups, and the size and fingerprint of every
input, before any tokenizing. A re-run keeps every group whose record is there, whose shards match
their sha256 and whose inputs match the plan's fingerprints, and does the rest; a finished
preparation is left as it is. A directory holding anything else, or a preparation of inputs that
have changed since, is refused in one line naming the first changed file (size or content); a
run's own cache of a glob (data/source.py) is prepared again instead. A directory given to a run
as `data.path` is checked against those of its recorded inputs that are readable where it runs
(`changed_input`; data/source.py). Prepared before fingerprints were recorded (no `fingerprints`
in its plan, no `inputs` in its index): a run's cache is prepared again; a finished directory is
taken as it is, unverified; an unfinished one redoes every group (no group record names its
inputs). Every file is written under a temporary name and renamed, so a kill never leaves a
half-written file under a final name (and two processes preparing the same inputs write the same
bytes).
"""
import contextlib
import hashlib
import multiprocessing
import os
import pickle
import queue
import re
import shutil
import sys
import tempfile
from stat import S_ISREG
import time

import numpy as np
from tqdm import tqdm

from data import ray_engine
from data.corpus import VAL_FRACTION, DataError, Shard, held_out, list_files
from data.files import (FORMAT, READ_BYTES, SPLITS, file_fingerprint, file_sha256, read_json,
                        sampled_fingerprint, spread,
                        write_atomic, write_json)
from data.records import (ON_BAD_RECORD, BadRecords, Reading, check_parquet_columns, cuttable,
                          describe_bad_records, documents, file_format, merge_bad_records,
                          parse_delimiter, row_groups, text_blocks, whole_file_sides)
from data.tokenizer import ByteTokenizer, make_tokenizer


def token_dtype(vocab_size: int) -> np.dtype:
  """The narrowest unsigned integer that holds every id (the byte tokenizer's: a byte each)."""
  return np.dtype(np.uint8 if vocab_size <= 2**8 else np.uint16 if vocab_size <= 2**16
                  else np.uint32)


def open_tokenizer(spec: str):
  """`data.tokenizer` / `--tokenizer`, or DataError in one line."""
  try:
    return make_tokenizer(spec)
  except ValueError as e:
    raise DataError(str(e)) from None


# ---- the plan: which documents, in which group, on which side ----------------------------------

SHARD_MB = 256   # --shard_mb: MiB of input per group, unless a command says

# The `split` of a plan entry whose file holds many documents, each sent to train or validation by
# a hash of the file and its place in it (data/records.py).
BY_DOCUMENT = 'by_document'


def make_plan(pattern: str, tokenizer, val_fraction: float, shard_mb: float,
              reading: Reading = Reading(), full: bool = True) -> dict:
  """Everything the preparation will do, fixed before any tokenizing (and compared on resume).
  `full`: with every input's fingerprint of its whole content and sampled one; else the sampled
  ones of a spread of SAMPLED_FILES inputs alone (the bounded check of a run's start,
  `prepared_already`)."""
  if not shard_mb > 0:
    raise DataError(f'--shard_mb={shard_mb!r} must be a positive number of MiB')
  if not 0 < val_fraction <= 0.5:
    raise DataError(f'val_fraction={val_fraction!r} must be in (0, 0.5]')
  reading.check()
  root, files = list_files(pattern)
  formats = {path: file_format(path) for path in files}
  check_parquet_columns([p for p in files if formats[p] == 'parquet'], reading, root)
  train, val = whole_file_sides(root, files, reading, val_fraction)
  sizes = {path: os.path.getsize(path) for path in files}
  by_document = []
  for path in (p for p in files if reading.by_document(formats[p])):
    # An uncompressed JSON Lines or Parquet file larger than a group is cut (a Parquet file into
    # no more pieces than it has row groups), so that workers share it.
    pieces = max(1, int(sizes[path] // (shard_mb * 2**20))) if cuttable(formats[path]) else 1
    if formats[path] == 'parquet' and pieces > 1:
      pieces = min(pieces, row_groups(path))
    by_document += [Shard(path, i / pieces, (i + 1) / pieces) for i in range(pieces)]
  groups = []
  for split, documents in (('train', train), ('val', val), (BY_DOCUMENT, by_document)):
    group, group_bytes = [], 0   # a group holds one split's documents (or files of documents)
    for doc in sorted(documents):
      start, stop = doc.byte_range(sizes[doc.path])
      if group and group_bytes + (stop - start) > shard_mb * 2**20:
        groups.append(group)
        group, group_bytes = [], 0
      group.append([os.path.relpath(doc.path, root), doc.start_fraction, doc.end_fraction, split])
      group_bytes += stop - start
    if group:
      groups.append(group)
  plan = {'format': FORMAT, 'input': pattern, 'root': root, 'tokenizer': tokenizer.identity(),
          'dtype': token_dtype(tokenizer.vocab_size).name, 'val_fraction': val_fraction,
          'files': {os.path.relpath(p, root): s for p, s in sizes.items()}, 'groups': groups,
          # The content, not only the size: an input rewritten with other bytes of the same
          # length (and its mtime kept) must not pass for the one prepared. Sampled: what a run's
          # start checks without reading every input whole (data.verify_inputs).
          'samples': {os.path.relpath(p, root): sampled_fingerprint(p)
                      for p in (files if full else spread(files))}}
  if full:
    plan['fingerprints'] = {os.path.relpath(p, root): file_fingerprint(p) for p in files}
  if by_document:   # (absent from a plan of whole text files, as plans made before it had it)
    plan['reading'] = reading._asdict()
  return plan


# ---- the inputs' fingerprints: what changed since a preparation -------------------------------

def _records(inputs: dict, key: str = 'fingerprints') -> dict:
  """{relative path: (size, fingerprint)} of a plan, or of an index's `inputs` (the same keys);
  `key`: 'fingerprints' (of the whole content) or 'samples' (sampled)."""
  fingerprints = inputs.get(key, {})
  return {rel: (size, fingerprints.get(rel)) for rel, size in inputs['files'].items()}


def _first_change(root: str, before: dict, now: dict) -> str | None:
  """The first input, in path order, whose record differs between `before` and `now`, described
  in a few words; None when none does."""
  for rel in sorted(set(before) | set(now)):
    old, new = before.get(rel), now.get(rel)
    if old == new:
      continue
    path = os.path.join(root, rel)
    if old is None or new is None:
      return f'{path} is {"new" if old is None else "gone"}'
    if old[0] != new[0]:
      return f'{path} changed size: {old[0]} bytes, now {new[0]}'
    return f'{path} changed content, same size'
  return None


def _readable_record(path: str, size: int, fingerprint=file_fingerprint) -> tuple | None:
  """(size, fingerprint) of `path` now (the fingerprint only if the size still matches: a changed
  size needs no read); None where it is absent or unreadable."""
  try:
    stat = os.stat(path)   # one call a file: a start may check hundreds of thousands
    if not S_ISREG(stat.st_mode):
      return None
    return stat.st_size, fingerprint(path) if stat.st_size == size else None
  except OSError:
    return None


def changed_input(inputs: dict, verify: str = 'full') -> str | None:
  """For an index's `inputs`: the first recorded input that is readable here and differs from its
  record (size or content), described; None when every readable one matches. An absent input is
  not a change: a prepared directory is often used where its inputs are not. `verify`: 'full'
  reads every input whole; 'sampled' the sizes of all and a bounded part (`sampled_fingerprint`)
  of a spread of SAMPLED_FILES of them, where the index records sampled fingerprints (else every
  input whole, as before them)."""
  sampled = verify == 'sampled' and 'samples' in inputs
  key, fingerprint = (('samples', sampled_fingerprint) if sampled
                      else ('fingerprints', file_fingerprint))
  recorded = _records(inputs, key)
  read = set(spread(sorted(recorded))) if sampled else set(recorded)   # the others: their sizes
  now = {rel: record for rel, (size, fp) in recorded.items()
         if (record := _readable_record(os.path.join(inputs['root'], rel), size,
                                        fingerprint if rel in read else lambda _: fp))
         is not None}
  return _first_change(inputs['root'], {rel: recorded[rel] for rel in now}, now)


# ---- one group: tokenize its documents into one shard per split --------------------------------

NUL_REASON = ('a NUL byte, which the byte tokenizer keeps for document boundaries (id 0): not '
              'text it can prepare')


def _first_nul(path: str, start: int, stop: int) -> int | None:
  """The offset of the first NUL byte in [start, stop) of a file, or None."""
  with open(path, 'rb') as f:
    f.seek(start)
    offset = start
    while offset < stop:
      block = f.read(min(READ_BYTES, stop - offset))
      if not block:
        break
      if (at := block.find(0)) >= 0:
        return offset + at
      offset += len(block)
  return None


class _ShardWriter:
  """One shard being written: token ids under a temporary name, with where each document starts;
  `close` renames both files into place (and drops a shard that got no document)."""

  def __init__(self, out: str, name: str, dtype: str):
    self.out, self.name, self.dtype = out, name, np.dtype(dtype)
    self.path = os.path.join(out, name + '.bin')
    self.temporary = f'{self.path}.tmp{os.getpid()}'
    self.file = open(self.temporary, 'wb')
    self.digest = hashlib.sha256()
    self.offsets: list[int] = []
    self.tokens = self.bytes = 0

  def start_document(self, input_bytes: int) -> None:
    self.offsets.append(self.tokens)
    self.bytes += input_bytes

  def put(self, ids) -> None:
    data = np.asarray(ids).astype(self.dtype).tobytes()
    self.file.write(data)
    self.digest.update(data)
    self.tokens += len(ids)

  def close(self, split: str) -> dict | None:
    """The shard's entry in its group's record, or None where it holds no document."""
    self.file.close()
    if not self.offsets:
      os.remove(self.temporary)
      return None
    os.replace(self.temporary, self.path)
    docs_path = os.path.join(self.out, self.name + '.docs.npy')
    write_atomic(docs_path, lambda f: np.save(f, np.asarray(self.offsets, np.int64)))
    return {'split': split, 'name': self.name, 'tokens': self.tokens,
            'documents': len(self.offsets), 'bytes': self.bytes,
            'sha256': self.digest.hexdigest(), 'docs_sha256': file_sha256(docs_path),
            'sample': sampled_fingerprint(self.path), 'docs_sample': sampled_fingerprint(docs_path)}

  def abort(self) -> None:
    self.file.close()
    if os.path.exists(self.temporary):
      os.remove(self.temporary)


class _Group:
  """Writes one group's documents, each as [bos] + tokens + [eos], into its shards."""

  def __init__(self, out: str, index: int, tokenizer, dtype: str, bad: BadRecords):
    self.tokenizer, self.bad = tokenizer, bad
    self.writers = {split: _ShardWriter(out, f'{split}-{index:05d}', dtype) for split in SPLITS}
    self.is_bytes = isinstance(tokenizer, ByteTokenizer)

  def whole_file(self, path: str, start: int, stop: int, split: str) -> None:
    """A text file's byte range as one document, streamed in pieces."""
    if self.is_bytes and (at := _first_nul(path, start, stop)) is not None:
      self.bad.add(NUL_REASON, f'{path} byte {at}')
      return
    writer = self.writers[split]
    writer.start_document(stop - start)
    self._marker(writer, self.tokenizer.bos_id)
    for piece in text_blocks(path, start, stop, cut_at_newline=not self.is_bytes):
      writer.put(self.tokenizer.encode(piece))
    self._marker(writer, self.tokenizer.eos_id)

  def records(self, path: str, fmt: str, rel: str, reading: Reading, val_fraction: float,
              start: int, stop: int | None) -> None:
    """A file of documents, each sent to train or validation by the hash of its file and key,
    tokenized a batch at a time."""
    batch, batch_bytes = [], 0
    for doc in documents(path, fmt, reading, self.bad, start, stop, name=path):
      try:
        data = doc.text.encode('utf-8')
      except UnicodeEncodeError:
        self.bad.add('text that is not valid Unicode (a lone surrogate)', doc.place())
        continue
      if self.is_bytes and b'\x00' in data:
        self.bad.add(NUL_REASON, doc.place())
        continue
      split = 'val' if held_out(f'{rel}:{doc.key}', val_fraction) else 'train'
      batch.append((split, doc.text, data))
      batch_bytes += len(data)
      if batch_bytes >= READ_BYTES or len(batch) >= 4096:
        self._write_batch(batch)
        batch, batch_bytes = [], 0
    self._write_batch(batch)

  def _write_batch(self, batch: list) -> None:
    if not batch:
      return
    if self.is_bytes:
      encoded = [np.frombuffer(data, np.uint8) for _, _, data in batch]
    else:
      encoded = self.tokenizer.encode_batch([text for _, text, _ in batch])
    bos, eos = (np.asarray([] if m is None else [m], np.int64)
                for m in (self.tokenizer.bos_id, self.tokenizer.eos_id))
    for (split, _, data), ids in zip(batch, encoded):
      writer = self.writers[split]
      writer.start_document(len(data))
      writer.put(np.concatenate([bos, ids, eos]))

  @staticmethod
  def _marker(writer: _ShardWriter, token: int | None) -> None:
    if token is not None:
      writer.put([token])

  def close(self) -> list[dict]:
    return [entry for split, writer in self.writers.items()
            if (entry := writer.close(split)) is not None]

  def abort(self) -> None:
    for writer in self.writers.values():
      writer.abort()


def prepare_group(out: str, index: int, group: list, root: str, tokenizer_spec: str,
                  dtype: str, inputs: dict, reading: dict | None = None,
                  val_fraction: float = VAL_FRACTION, on_bad_record: str = 'fail') -> dict:
  """Tokenizes group `index` into its shards and writes its record (with `inputs`, the plan's
  fingerprints of the group's files, and the bad records skipped); returns the record. On an
  error nothing of the group is left under a final name."""
  tokenizer = open_tokenizer(tokenizer_spec)
  reading = Reading(**(reading or {}))
  bad = BadRecords(on_bad_record)
  writing = _Group(out, index, tokenizer, dtype, bad)
  try:
    for relpath, start_fraction, end_fraction, split in group:
      path = os.path.join(root, relpath)
      start, stop = Shard(path, start_fraction, end_fraction).byte_range(os.path.getsize(path))
      if split == BY_DOCUMENT:
        fmt = file_format(path)
        writing.records(path, fmt, relpath, reading, val_fraction,
                        *((start, stop) if cuttable(fmt) else (0, None)))
      else:
        writing.whole_file(path, start, stop, split)
  except BaseException:
    writing.abort()
    raise
  record = {'group': index, 'inputs': inputs, 'shards': writing.close()}
  if bad.reasons:
    record['bad_records'] = bad.to_json()
  write_json(os.path.join(out, f'group-{index:05d}.json'), record)
  return record


def _group_inputs(plan: dict, group: list) -> dict:
  return {rel: plan['fingerprints'][rel] for rel, *_ in group}


def _group_done(out: str, index: int, inputs: dict) -> dict | None:
  """The group's record if it and every file it names are there and match, and it was made from
  `inputs` (its files' fingerprints now); else None."""
  path = os.path.join(out, f'group-{index:05d}.json')
  if not os.path.isfile(path):
    return None
  try:
    record = read_json(path)
    # Its inputs too, not only its shards: a group made before an input changed is made again
    # (the plan's check already refuses that, except for a plan from before fingerprints).
    if record.get('inputs') != inputs:
      return None
    for shard in record['shards']:
      base = os.path.join(out, shard['name'])
      if (file_sha256(base + '.bin') != shard['sha256']
          or file_sha256(base + '.docs.npy') != shard['docs_sha256']):
        return None
  except (OSError, ValueError, KeyError):
    return None
  return record


def _run_group(args) -> dict:
  return prepare_group(*args)


# ---- the whole preparation ---------------------------------------------------------------------

def _check_out(out: str, plan: dict, rebuild_stale: bool = False) -> dict | None:
  """Refuses an --out that holds anything but an earlier try at this same plan. With
  `rebuild_stale` (a run's own cache of a glob) a preparation of other inputs, or of inputs that
  have changed since, is removed instead, in one line, and prepared again. Returns the earlier
  try's plan as stored, where one is kept (None otherwise)."""
  plan_path = os.path.join(out, 'plan.json')
  if os.path.isfile(plan_path):
    stored = original = read_json(plan_path)
    if 'fingerprints' not in stored and not rebuild_stale:
      # Prepared before fingerprints: taken unverified (finished), or every group redone.
      stored = {**stored, 'fingerprints': plan['fingerprints']}
    if 'samples' not in stored:   # prepared before sampled fingerprints: the whole ones decide
      stored = {**stored, 'samples': plan['samples']}
    _keep_wider_dtype(stored, plan)
    what = _plan_change(stored, plan)
    if what is None:
      return original
    if rebuild_stale:
      print(f'data        {out} was prepared from other inputs ({what}); preparing it again')
      shutil.rmtree(out)
      return
    raise DataError(f'--out={out!r} holds a preparation of other inputs ({what}); give '
                    f'another --out, or delete that one to redo it')
  elif os.path.isdir(out) and os.listdir(out):
    raise DataError(f'--out={out!r} is not empty and holds no preparation (no plan.json); give a '
                    'new or empty directory, nothing there is overwritten')
  return None


def _keep_wider_dtype(stored: dict, plan: dict) -> None:
  """A preparation from before uint8 shards (byte tokens as uint16) keeps its type: the plan's is
  the narrowest that holds the vocabulary, so a wider one holds every id too, and readers take the
  type from the index."""
  if np.dtype(stored['dtype']).itemsize > np.dtype(plan['dtype']).itemsize:
    plan['dtype'] = stored['dtype']


def _record_samples(out: str, plan: dict, index: dict) -> dict:
  """A finished preparation from before sampled fingerprints, its inputs just checked whole
  against their recorded fingerprints: the sampled ones of its inputs and shards recorded now
  (plan.json, then index.json, each written atomically), so that a run's start can check it with
  a bounded read. Nothing else in either file changes."""
  write_json(os.path.join(out, 'plan.json'), plan)
  for split in SPLITS:
    for entry in index['splits'][split]['shards']:
      entry['sample'] = sampled_fingerprint(os.path.join(out, entry['name'] + '.bin'))
      entry['docs_sample'] = sampled_fingerprint(os.path.join(out, entry['name'] + '.docs.npy'))
  index['inputs'] = {k: plan[k] for k in ('root', 'files', 'fingerprints', 'samples')}
  write_json(os.path.join(out, 'index.json'), index)
  return index


def _plan_change(stored: dict, plan: dict) -> str | None:
  """How an earlier plan differs from this one, in a few words: the first changed input where only
  the inputs differ; None when they are the same."""
  if stored == plan:
    return None
  if 'fingerprints' not in stored:
    return 'no fingerprints of its inputs: prepared by an older version'
  differs = sorted(k for k in set(plan) | set(stored) if plan.get(k) != stored.get(k))
  # The groups follow from the files and their sizes.
  if set(differs) <= {'files', 'fingerprints', 'samples', 'groups'}:
    changed = (_first_change(plan['root'], _records(stored), _records(plan)) or _first_change(
        plan['root'], _records(stored, 'samples'), _records(plan, 'samples')))
    if changed:
      return changed
  return f'its {", ".join(differs)} differ'


def prepared_already(pattern: str, tokenizer_spec: str, out: str, *,
                     val_fraction: float = VAL_FRACTION, shard_mb: float = SHARD_MB,
                     reading: Reading = Reading()) -> bool:
  """Whether `out` holds a finished preparation of this plan whose inputs keep the sizes and the
  sampled fingerprints they had: a bounded read of each input (`prepare` reads them whole). False
  for a preparation from before sampled fingerprints, which `prepare` then checks whole."""
  plan_path = os.path.join(out, 'plan.json')
  if not (os.path.isfile(plan_path) and os.path.isfile(os.path.join(out, 'index.json'))):
    return False
  stored = read_json(plan_path)
  if 'samples' not in stored:
    return False
  plan = make_plan(pattern, open_tokenizer(tokenizer_spec), val_fraction, shard_mb, reading,
                   full=False)
  _keep_wider_dtype(stored, plan)
  stored['samples'] = {rel: stored['samples'].get(rel) for rel in plan['samples']}
  return {k: v for k, v in stored.items() if k != 'fingerprints'} == plan


def build_index(plan: dict, records: list[dict]) -> dict:
  splits = {}
  for split in SPLITS:
    shards = [s for r in sorted(records, key=lambda r: r['group']) for s in r['shards']
              if s['split'] == split]
    splits[split] = {'tokens': sum(s['tokens'] for s in shards),
                     'documents': sum(s['documents'] for s in shards),
                     'bytes': sum(s['bytes'] for s in shards), 'shards': shards}
  return {'format': FORMAT, 'tokenizer': plan['tokenizer'], 'dtype': plan['dtype'],
          'input': plan['input'], 'val_fraction': plan['val_fraction'],
          'files': len(plan['files']), 'splits': splits,
          # Every input's size and fingerprint, where a reader of the directory finds them.
          'inputs': {k: plan[k] for k in ('root', 'files', 'fingerprints', 'samples')},
          **({'reading': plan['reading']} if 'reading' in plan else {}),
          **({'bad_records': bad} if (bad := merge_bad_records(
              [r.get('bad_records', {}) for r in sorted(records, key=lambda r: r['group'])]))
             else {})}


ENGINES = ('local', 'ray')


@contextlib.contextmanager
def _local_groups(jobs: list, workers: int):
  """An iterator of the jobs' group records, in this process or a pool of `workers` processes."""
  if workers == 1 or len(jobs) <= 1:
    yield map(_run_group, jobs)
    return
  count = min(workers, len(jobs))
  # spawn: the workers import only what they need, whatever threads the parent has started. Each
  # job (a group's file list can pickle to a megabyte) waits in a file of its own, read by the
  # worker that runs it; the pool's pipe carries only job numbers, a few at a time, so it never
  # fills. A full pipe whose readers `terminate` has killed hangs `terminate` (CPython issues
  # 78178 and 96995; seen here once, after a bad record, when the pipe carried the jobs).
  with tempfile.TemporaryDirectory(prefix='data-prepare-jobs-') as folder:
    for number, job in enumerate(jobs):
      with open(os.path.join(folder, f'{number}.pickle'), 'wb') as f:
        pickle.dump(job, f)
    before = set(multiprocessing.active_children())
    pool = multiprocessing.get_context('spawn').Pool(count)
    started = set(multiprocessing.active_children()) - before
    try:
      yield _as_finished(pool, folder, len(jobs), 2 * count, started)
    finally:
      pool.terminate()
      pool.join()


def _run_job(folder: str, number: int) -> dict:
  with open(os.path.join(folder, f'{number}.pickle'), 'rb') as f:
    return prepare_group(*pickle.load(f))


def _as_finished(pool, folder: str, jobs: int, window: int, workers: set):
  """The records of jobs 0 .. jobs-1 as they finish, at most `window` of them in the pool at once;
  a job's error is raised here, and so is the death of one of the pool's `workers` (killed by the
  system, out of memory: its job would never answer)."""
  finished = queue.SimpleQueue()
  submitted = 0
  def submit():
    nonlocal submitted
    pool.apply_async(_run_job, (folder, submitted), callback=finished.put,
                     error_callback=finished.put)
    submitted += 1
  for _ in range(min(window, jobs)):
    submit()
  for _ in range(jobs):
    while True:
      try:
        record = finished.get(timeout=1)
        break
      except queue.Empty:
        dead = [p for p in workers if not p.is_alive()]
        if dead:
          raise DataError(f'a preparing worker process died (exit code {dead[0].exitcode}: killed '
                          'by the system, out of memory?); run the same command again to go on '
                          'from the groups already done, with fewer --workers if memory is short')
    if isinstance(record, BaseException):
      raise record
    if submitted < jobs:
      submit()
    yield record


def prepare(pattern: str, tokenizer_spec: str, out: str, *, workers: int = 1,
            val_fraction: float = VAL_FRACTION, shard_mb: float = SHARD_MB, progress: bool = True,
            rebuild_stale: bool = False, reading: Reading = Reading(),
            on_bad_record: str = 'fail', engine: str = 'local',
            ray_address: str | None = None) -> dict:
  """Prepares (or finishes preparing) `pattern` into `out`; returns the index. `rebuild_stale`:
  `out` is a cache of ours, prepared again when its inputs changed (else that is refused).
  `reading`: the text field and document delimiter; `on_bad_record`: 'fail' or 'skip' (not part
  of the plan: a preparation stopped by a bad record resumes with `skip`). `engine`: 'local' (this
  process, or a pool of `workers`) or 'ray' (data/ray_engine.py: a Ray of `workers` CPUs started
  here, or the cluster at `ray_address`); the files are the same either way."""
  if workers < 1:
    raise DataError(f'--workers={workers!r} must be a positive integer')
  if engine not in ENGINES:
    raise DataError(f'--engine={engine!r}; allowed: {", ".join(ENGINES)}')
  if engine == 'ray':
    ray_engine.require_ray()
  BadRecords(on_bad_record)   # checks the value
  tokenizer = open_tokenizer(tokenizer_spec)
  plan = make_plan(pattern, tokenizer, val_fraction, shard_mb, reading)
  stored = _check_out(out, plan, rebuild_stale)
  index_path = os.path.join(out, 'index.json')
  if os.path.isfile(index_path):
    index = read_json(index_path)
    if stored is not None and 'fingerprints' in stored and 'samples' not in stored:
      index = _record_samples(out, plan, index)
    return index
  os.makedirs(out, exist_ok=True)
  _remove_leftovers(out)
  write_json(os.path.join(out, 'plan.json'), plan)

  inputs = [_group_inputs(plan, g) for g in plan['groups']]
  records = {i: _group_done(out, i, inputs[i]) for i in range(len(plan['groups']))}
  todo = [i for i, r in records.items() if r is None]
  sizes = [_group_bytes(plan, g) for g in plan['groups']]
  jobs = [(out, i, plan['groups'][i], plan['root'], tokenizer_spec, plan['dtype'], inputs[i],
           plan.get('reading'), val_fraction, on_bad_record) for i in todo]
  bar = tqdm(total=sum(sizes[i] for i in todo), unit='B', unit_scale=True, disable=not progress,
             desc=f'prepare {len(todo)} of {len(sizes)} groups')
  groups = (ray_engine.ray_groups(_run_group, jobs, workers, ray_address) if engine == 'ray'
            else _local_groups(jobs, workers))
  try:
    with groups as done:
      for record in done:
        records[record['group']] = record
        bar.update(sizes[record['group']])
  finally:
    bar.close()
    # A group's failure stops the others mid-write: their temporary files go now, not at the
    # next try (on a loaded machine the good group of tests/test_corpora.py's bad-record case
    # was still writing when the bad one failed, and its file stayed); so do those of a Ray
    # task whose worker died mid-group and was run again.
    _remove_leftovers(out)
  index = build_index(plan, list(records.values()))
  write_json(index_path, index)
  return index


def _remove_leftovers(out: str) -> None:
  """Removes the temporary files of an earlier try's workers that were stopped mid-write (the
  directory is ours: its plan matched)."""
  for name in os.listdir(out):
    if re.search(r'\.tmp\d+$', name):
      os.remove(os.path.join(out, name))


def _group_bytes(plan: dict, group: list) -> int:
  ranges = (Shard(rel, a, b).byte_range(plan['files'][rel]) for rel, a, b, _ in group)
  return sum(stop - start for start, stop in ranges)


def _summary(index: dict, seconds: float, out: str) -> str:
  lines = [f'prepared    {index["files"]} files into {out} in {seconds:.1f} s '
           f'({index["tokenizer"]["name"]} tokenizer, {index["dtype"]})']
  for split, s in index['splits'].items():
    lines.append(f'{split:<11} {s["documents"]} documents, {s["bytes"] / 1e6:.2f} MB in, '
                 f'{s["tokens"]:,} tokens in {len(s["shards"])} shards')
  if index.get('bad_records'):
    lines.append(describe_bad_records(index['bad_records']))
  return '\n'.join(lines)


def main(argv=None) -> int:
  import argparse
  parser = argparse.ArgumentParser(prog='python -m data.prepare', description=__doc__.split('\n')[0])
  parser.add_argument('--input', required=True,
                      help="a glob ('**' recursive) of .jsonl, .jsonl.gz, .jsonl.zst, .parquet or "
                      "text files (any other name); '' = the embedded stdlib corpus")
  parser.add_argument('--text_field', default='text',
                      help='the field holding a JSON Lines record\'s or Parquet row\'s text; a '
                      'dotted path (meta.body) reaches into objects')
  parser.add_argument('--document_delimiter', default='',
                      help='cuts text files into documents where it occurs (\\n, \\t escapes '
                      'read: \'\\n\\n\' is a blank line; or e.g. \'<|endoftext|>\'); '
                      'default: a text file is one document')
  parser.add_argument('--on_bad_record', default='fail', choices=ON_BAD_RECORD,
                      help='fail: the first bad record stops, naming file, line and reason; skip: '
                      'bad records are skipped, counted per reason in the index and printed')
  parser.add_argument('--tokenizer', default='bytes',
                      help="'bytes', or a tokenizer.json / Hugging Face checkpoint directory")
  parser.add_argument('--out', required=True, help='the directory of shards (new, or an earlier try)')
  parser.add_argument('--workers', type=int, default=1,
                      help='tokenizing processes (--engine=ray: the CPUs of the Ray started here)')
  parser.add_argument('--engine', default='local', choices=ENGINES,
                      help='local: this machine\'s processes; ray: the groups as Ray tasks '
                      '(pip install ray), on a Ray started here or the cluster at --ray_address')
  parser.add_argument('--ray_address', default=None,
                      help="--engine=ray: a running cluster's address ('auto' on one of its "
                      'nodes); default: a Ray of --workers CPUs started for this preparation')
  parser.add_argument('--val_fraction', type=float, default=VAL_FRACTION)
  parser.add_argument('--shard_mb', type=float, default=SHARD_MB,
                      help='input MiB per group of shards')
  args = parser.parse_args(argv)
  started = time.perf_counter()
  try:
    index = prepare(args.input, args.tokenizer, args.out, workers=args.workers,
                    val_fraction=args.val_fraction, shard_mb=args.shard_mb,
                    reading=Reading(args.text_field, parse_delimiter(args.document_delimiter)),
                    on_bad_record=args.on_bad_record, engine=args.engine,
                    ray_address=args.ray_address)
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  print(_summary(index, time.perf_counter() - started, args.out))
  return 0


if __name__ == '__main__':
  sys.exit(main())
