"""The prepared directory's file conventions: its format number, splits, JSON records written
atomically, and file hashes."""
import hashlib
import json
import os

FORMAT = 1
SPLITS = ('train', 'val')
# Bytes read at once when hashing or tokenizing: a worker's memory bound.
READ_BYTES = 8 << 20


def file_sha256(path: str) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(READ_BYTES), b''):
      digest.update(block)
  return digest.hexdigest()


def file_fingerprint(path: str) -> str:
  """A fast content hash of a file (BLAKE2b, 128 bits)."""
  with open(path, 'rb') as f:
    return hashlib.file_digest(f, lambda: hashlib.blake2b(digest_size=16)).hexdigest()


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
