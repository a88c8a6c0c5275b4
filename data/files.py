"""The prepared directory's file conventions: its format number, splits, JSON records written
atomically, and file hashes."""
import hashlib
import json
import os

FORMAT = 1
SPLITS = ('train', 'val')
# Bytes read at once when hashing or tokenizing: a worker's memory bound.
READ_BYTES = 8 << 20


# How a run checks a prepared directory's inputs and shards when it starts (data.verify_inputs):
# 'sampled', a bounded read per file (`sampled_fingerprint`); 'full', every byte.
VERIFY_MODES = ('sampled', 'full')
VERIFY = 'sampled'   # the default
# Bytes read to check files against their records (`file_sha256`, `file_fingerprint`,
# `sampled_fingerprint`), counted for this process: what a start costs (bench/data.py, the tests).
verified = {'bytes': 0}


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(READ_BYTES), b''):
      digest.update(block)
      verified['bytes'] += len(block)
  return digest.hexdigest()


# A sampled fingerprint reads this many blocks of this size, spread evenly over the file. A sampled
# check reads it for at most SAMPLED_FILES of a preparation's inputs and of each split's shards
# (`spread`; a shard's .bin and .docs.npy), the sizes of all: at most 5 x 64 x 512 KiB = 160 MiB
# whatever the corpus's size.
SAMPLE_BLOCKS, SAMPLE_BYTES = 8, 64 << 10
SAMPLED_FILES = 64


def spread(items: list, most: int = SAMPLED_FILES) -> list:
  """At most `most` of `items` (in their order), spread evenly over them: every k-th."""
  step = -(-len(items) // most) if items else 1
  return items[::step]


def sampled_fingerprint(path: str) -> str:
  """BLAKE2b (128 bits) of a file's size and of SAMPLE_BLOCKS blocks of SAMPLE_BYTES spread evenly
  over it, the first and the last among them (a file no larger than they are, whole): a read of
  at most 512 KiB whatever the file's size. It sees a changed size and a change inside a sampled
  block; a change elsewhere that keeps the size passes (`file_fingerprint` sees that)."""
  size = os.path.getsize(path)
  digest = hashlib.blake2b(size.to_bytes(8, 'little'), digest_size=16)
  with open(path, 'rb') as f:
    if size <= SAMPLE_BLOCKS * SAMPLE_BYTES:
      blocks = [f.read()]
    else:
      last = size - SAMPLE_BYTES
      blocks = []
      for i in range(SAMPLE_BLOCKS):
        f.seek(last * i // (SAMPLE_BLOCKS - 1))
        blocks.append(f.read(SAMPLE_BYTES))
  for block in blocks:
    digest.update(block)
    verified['bytes'] += len(block)
  return digest.hexdigest()


def file_fingerprint(path: str) -> str:
  """A fast content hash of a file (BLAKE2b, 128 bits), of every byte."""
  with open(path, 'rb') as f:
    digest = hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()
  verified['bytes'] += os.path.getsize(path)
  return digest


def write_atomic(path: str, write) -> None:
  """write(file) into a temporary name beside `path`, then rename it into place: a kill never
  leaves a half-written file under the final name."""
  temporary = f'{path}.tmp{os.getpid()}'
  with open(temporary, 'wb') as f:
    write(f)
  os.replace(temporary, path)


def write_json(path: str, value) -> None:
  write_atomic(path, lambda f: f.write((json.dumps(value, indent=1, sort_keys=True) + '\n').encode()))


def read_json(path: str):
  with open(path, encoding='utf-8') as f:
    return json.load(f)
