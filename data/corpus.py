"""Which files make up a corpus, and how they split into train and validation.

The corpus is a glob of text files (`data.path`), or, when empty, the embedded default: every
`.py` file of the running interpreter's standard library (~1790 files, ~31.5 MB on Python 3.11),
which is on every machine that can run this code, so a run needs no download.

The train/validation split is a list of `Shard`s per side. Normally each file goes whole to one
side, chosen by a hash of its path relative to the corpus root. When that leaves one side empty
(a single file, or a few files that all hash the same way), every file is instead cut by bytes:
the first 1 - val_fraction of each file trains, the last val_fraction validates.
"""

import glob
import hashlib
import os
import sysconfig
from typing import NamedTuple, Sequence



class DataError(ValueError):
  """Bad data input: the message is one line naming the value and what is allowed."""


class Shard(NamedTuple):
  """The byte range [start_fraction, end_fraction) of one file, as fractions of its size."""
  path: str
  start_fraction: float = 0.0
  end_fraction: float = 1.0

  def byte_range(self, size: int) -> tuple[int, int]:
    """[start, stop) in bytes of a file of `size` bytes: the same int() of the same product for
    every reader (preparation, tokenizer training, the run's own cache)."""
    return int(size * self.start_fraction), int(size * self.end_fraction)


_EXCLUDED_DIRS = ("site-packages", "dist-packages")


def _stdlib_files() -> tuple[str, list[str]]:
  root = os.path.abspath(sysconfig.get_paths()["stdlib"])
  files = []
  for dirpath, dirnames, filenames in os.walk(root):
    # Installed third-party packages live under the stdlib dir; they are not part of the corpus.
    dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_DIRS]
    files.extend(os.path.join(dirpath, f) for f in filenames if f.endswith(".py"))
  files = sorted(f for f in files if os.path.isfile(f))
  if not files:
    raise DataError(f"data.path='' (the embedded corpus) found no .py files under {root!r}; "
                    "give a glob of text files such as 'corpus/**/*.txt'")
  return root, files


def list_files(path_glob: str) -> tuple[str, list[str]]:
  """Returns (root, sorted absolute paths) of the corpus that `data.path` names.

  '' is the embedded standard-library corpus, rooted at the stdlib dir. Otherwise `path_glob` is
  a glob (`**` recursive, `~` expanded) matched to regular files; root is their common directory.
  """
  if not path_glob:
    return _stdlib_files()
  matches = glob.glob(os.path.expanduser(path_glob), recursive=True)
  files = sorted({os.path.abspath(m) for m in matches if os.path.isfile(m)})
  if not files:
    raise DataError(f"data.path={path_glob!r} matches no files; give a glob of text files such as "
                    "'corpus/**/*.txt', or '' for the embedded standard-library corpus")
  root = os.path.commonpath([os.path.dirname(f) for f in files])
  return root, files


def hash_fraction(relpath: str) -> float:
  # sha256, not hash(): Python salts str hashes per process, and the split must never change.
  return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:8], 16) / 2**32


VAL_FRACTION = 0.05   # the share of documents held out for validation unless a command says


def held_out(place: str, val_fraction: float) -> bool:
  """Whether the document at `place` (a file's path relative to the corpus root, or that path and
  the document's key in the file, `path:key`) validates rather than trains."""
  return hash_fraction(place) < val_fraction


def split_files(root: str, files: Sequence[str],
                val_fraction: float) -> tuple[list[Shard], list[Shard]]:
  """Splits the corpus into (train_shards, val_shards), the same way on every run and machine.

  A file goes to validation when the sha256 of its path relative to `root` (with '/' separators),
  read as a fraction in [0, 1), is below `val_fraction`. If that leaves either side empty, every
  file is cut by bytes instead: the last `val_fraction` of each file's bytes validates.
  """
  if not 0 < val_fraction <= 0.5:
    raise DataError(f"val_fraction={val_fraction!r} must be in (0, 0.5]")
  if not files:
    raise DataError(f"the corpus under root={root!r} has no files to split")
  train, val = [], []
  for path in sorted(files):
    relpath = os.path.relpath(path, root).replace(os.sep, "/")
    (val if held_out(relpath, val_fraction) else train).append(Shard(path))
  if train and val:
    return train, val
  cut = 1.0 - val_fraction
  return ([Shard(path, 0.0, cut) for path in sorted(files)],
          [Shard(path, cut, 1.0) for path in sorted(files)])
