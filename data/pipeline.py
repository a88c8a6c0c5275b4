"""The training and evaluation batch streams: packed windows, per-process shares, exact resume.

The loader is a grain.MapDataset, i.e. random access: the batch at step s is a pure function of
(seed, s). The iterator's state is therefore just the step number (plus what identifies the
stream, to refuse a state from another one), and resuming is exact by construction.

The stream of window indices is shuffle -> repeat: a fresh permutation of all windows for each
epoch, forever. It is cut into global batches of global_batch_size consecutive indices, so a
batch may straddle two epochs but every window is seen exactly once per epoch. Process p of P
takes rows [p*B/P, (p+1)*B/P) of each global batch and reads only those windows.
"""

import hashlib
import numbers

import grain
import numpy as np

from data.corpus import DataError
from data.windows import count_windows, gather_windows


# Windows in the repeated stream: far more than any run reads, and a length grain can still batch.
_ENDLESS_WINDOWS = 2**62


def _check_sharding(batch_size: int, process_index: int, process_count: int, name: str) -> int:
  """Returns the rows per process after checking the batch splits evenly across processes."""
  if batch_size < 1:
    raise DataError(f"{name}={batch_size!r} must be a positive integer")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index!r} must be in [0, process_count={process_count!r})")
  if batch_size % process_count:
    raise DataError(f"{name}={batch_size} must be divisible by the number of processes "
                    f"({process_count}) so each process gets the same number of rows")
  return batch_size // process_count


def _shuffle_seed(seed: int) -> int:
  # grain shuffles epoch e with (seed + e) mod 2**32, so user seeds 0 and 1 would share all but
  # one epoch's order. Hashing the seed first makes neighbouring seeds unrelated.
  return int(hashlib.sha256(f"TokenBatches/{seed}".encode()).hexdigest()[:8], 16)


def _process_batches(window_order: grain.MapDataset, tokens: np.ndarray, seq_len: int,
                     global_batch_size: int, process_index: int,
                     process_count: int) -> grain.MapDataset:
  """Batch s of the result is process `process_index`'s rows of global batch s."""
  rows = global_batch_size // process_count
  # Batching the stream by the per-process row count makes global batch s the P consecutive
  # local batches s*P .. s*P+P-1; the slice keeps this process's one, so only its windows are read.
  return (window_order.batch(rows)
          .slice(slice(process_index, None, process_count))
          .map(lambda window_indices: gather_windows(tokens, window_indices, seq_len)))


class TokenBatches:
  """Endless, checkpointable iterator of {'inputs', 'targets'}: int32 [B/P, seq_len] batches."""

  def __init__(self, tokens: np.ndarray, *, seq_len: int, global_batch_size: int, seed: int,
               shuffle: bool = True, process_index: int = 0, process_count: int = 1):
    self._tokens = np.asarray(tokens)
    self._num_windows = count_windows(self._tokens, seq_len)
    _check_sharding(global_batch_size, process_index, process_count, "global_batch_size")
    self._seq_len = seq_len
    self._global_batch_size = global_batch_size
    self._seed = int(seed)
    self._shuffle = bool(shuffle)
    window_order = grain.MapDataset.range(self._num_windows)
    if self._shuffle:
      window_order = window_order.shuffle(seed=_shuffle_seed(self._seed))
    # repeat() reseeds the shuffle per epoch. A finite (if unreachable) epoch count: grain's
    # endless repeat has length sys.maxsize, and batching that by one row overflows its length.
    window_order = window_order.repeat(num_epochs=max(_ENDLESS_WINDOWS // self._num_windows, 1))
    self._batches = _process_batches(window_order, self._tokens, seq_len, global_batch_size,
                                     process_index, process_count)
    self._step = 0

  @property
  def num_windows(self) -> int:
    return self._num_windows

  @property
  def tokens_per_batch(self) -> int:
    """Input tokens in one global batch (all processes together)."""
    return self._global_batch_size * self._seq_len

  def __iter__(self) -> "TokenBatches":
    return self

  def __next__(self) -> dict:
    batch = self._batches[self._step]
    self._step += 1
    return batch

  def _identity(self) -> dict:
    # What must match for a saved step to mean the same batches. The process layout is not part
    # of it: the step counts global batches, so a run may resume on a different process count.
    return {"seed": self._seed, "seq_len": self._seq_len,
            "global_batch_size": self._global_batch_size,
            "num_tokens": int(len(self._tokens)), "shuffle": self._shuffle}

  def get_state(self) -> dict:
    """A JSON-serializable dict: the next step to yield plus the stream's identity."""
    return {"step": self._step, **self._identity()}

  def set_state(self, state: dict) -> None:
    """Continues from `state` so the next batches are those an uninterrupted run would yield."""
    expected = self._identity()
    for key, value in expected.items():
      if state.get(key) != value:
        raise DataError(f"data iterator state has {key}={state.get(key)!r} but this run has "
                        f"{key}={value!r}; a state resumes only the same corpus, seed and shapes")
    step = state.get("step")
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
      raise DataError(f"data iterator state has step={step!r}; it must be a non-negative integer")
    self._step = int(step)


def eval_batches(tokens: np.ndarray, *, seq_len: int, batch_size: int, num_batches: int,
                 process_index: int = 0, process_count: int = 1) -> list[dict]:
  """The first num_batches * batch_size windows, unshuffled, as this process's rows per batch.

  Fewer batches when the corpus holds fewer whole batches; a DataError when it holds none.
  """
  num_windows = count_windows(np.asarray(tokens), seq_len)
  _check_sharding(batch_size, process_index, process_count, "batch_size")
  if num_batches < 1:
    raise DataError(f"num_batches={num_batches!r} must be a positive integer")
  num_batches = min(num_batches, num_windows // batch_size)
  if num_batches < 1:
    raise DataError(f"the evaluation corpus has {len(tokens)} tokens = {num_windows} sequences of "
                    f"seq_len={seq_len}; one eval batch needs batch_size={batch_size} sequences")
  window_order = grain.MapDataset.range(num_batches * batch_size)
  batches = _process_batches(window_order, np.asarray(tokens), seq_len, batch_size,
                             process_index, process_count)
  return [batches[i] for i in range(num_batches)]
