"""The training and evaluation batches: rows per process, exact resume, a fixed evaluation set.

Training: a grain.MapDataset, random access, so the batch at step s is a pure function of
(seed, s) and the iterator's state is just the step number (plus what identifies the stream, to
refuse a state from another one). Row r of the global batch (of B rows) draws from its own lane:
the r-th of B contiguous ranges of the split's windows, shuffled afresh every epoch of the lane.
So every batch takes one window from each 1/B of the corpus; process p of P, which feeds rows
[p*B/P, (p+1)*B/P), reads only its lanes' windows, i.e. only the shards of its 1/P of the corpus
(with a neighbouring process it shares at most the shard its boundary falls in); and the batches do
not depend on P, so a run resumes on another process count with the same data.

Evaluation: a fixed set of windows spread evenly over the validation split, enough for
`train.eval_tokens`, laid out as [batches, B rows] so that each row (and so each process) reads a
contiguous run of them.
"""
import hashlib
import numbers

import grain
import numpy as np

from data.corpus import DataError
from data.windows import Windows

# Steps in the stream: far more than any run takes.
ENDLESS = 2**62


def check_sharding(batch_size: int, process_index: int, process_count: int, name: str) -> int:
  """Returns the rows per process after checking the batch splits evenly across processes."""
  if batch_size < 1:
    raise DataError(f"{name}={batch_size!r} must be a positive integer")
  if process_count < 1 or not 0 <= process_index < process_count:
    raise DataError(f"process_index={process_index!r} must be in [0, process_count={process_count!r})")
  if batch_size % process_count:
    raise DataError(f"{name}={batch_size} must be divisible by the number of processes "
                    f"({process_count}) so each process gets the same number of rows")
  return batch_size // process_count


def stream_seed(*parts) -> int:
  """A 32-bit shuffle seed from the parts that name a stream, e.g. ('TokenBatches', seed, lane).
  grain shuffles epoch e with (seed + e) mod 2**32, so user seeds 0 and 1 would share all but one
  epoch's order: hashing first makes neighbouring seeds (and lanes) unrelated."""
  return int(hashlib.sha256('/'.join(map(str, parts)).encode()).hexdigest()[:8], 16)


def lane_orders(windows: Windows, lanes: range, global_batch_size: int, stream: tuple,
                shuffle: bool = True) -> list:
  """The endless window order of each lane in `lanes`: lane r of a global batch of B rows is the
  r-th of B contiguous ranges of the split's windows, shuffled afresh every epoch of the lane
  (seeded by `stream` and the lane) unless `shuffle` is False. The shards the lanes lie in are
  opened (and checked against their index) now, before a run compiles or writes anything, not at
  the first batch."""
  total = windows.num_windows
  if total < global_batch_size:
    raise DataError(f"the train split has {total} windows of seq_len={windows.seq_len}; "
                    f"train.batch_size={global_batch_size} needs one per row at least: use a "
                    "smaller batch or seq_len, or more data")
  bounds = [(lane * total // global_batch_size, (lane + 1) * total // global_batch_size)
            for lane in lanes]
  windows.open_windows(bounds[0][0], bounds[-1][1])
  orders = []
  for lane, (low, high) in zip(lanes, bounds):
    order = grain.MapDataset.range(low, high)
    if shuffle:
      order = order.shuffle(seed=stream_seed(*stream, lane))
    # repeat() reseeds the shuffle per epoch.
    orders.append(order.repeat(num_epochs=ENDLESS // (high - low)))
  return orders


class TokenBatches:
  """Endless, checkpointable iterator of {'inputs', 'targets', 'segments'}: int32 [B/P, seq_len]."""

  def __init__(self, windows: Windows, *, global_batch_size: int, seed: int, shuffle: bool = True,
               process_index: int = 0, process_count: int = 1):
    rows = check_sharding(global_batch_size, process_index, process_count, "train.batch_size")
    self._windows = windows
    self._global_batch_size = global_batch_size
    self._seed, self._shuffle = int(seed), bool(shuffle)
    lanes = range(process_index * rows, (process_index + 1) * rows)
    orders = lane_orders(windows, lanes, global_batch_size, ('TokenBatches', self._seed),
                         self._shuffle)
    self._batches = grain.MapDataset.range(ENDLESS).map(
        lambda step: windows.gather([order[step] for order in orders]))
    self._step = 0

  @property
  def num_windows(self) -> int:
    return self._windows.num_windows

  @property
  def tokens_per_batch(self) -> int:
    """Input tokens in one global batch (all processes together)."""
    return self._global_batch_size * self._windows.seq_len

  def __iter__(self) -> "TokenBatches":
    return self

  def __next__(self) -> dict:
    batch = self._batches[self._step]
    self._step += 1
    return batch

  def _identity(self) -> dict:
    # What must match for a saved step to mean the same batches. The process layout is not part
    # of it: the step counts global batches, so a run may resume on a different process count.
    shards = self._windows.shards
    return {"seed": self._seed, "seq_len": self._windows.seq_len,
            "global_batch_size": self._global_batch_size, "packing": self._windows.packing,
            "num_tokens": int(shards.tokens.sum()), "num_windows": self.num_windows,
            "shuffle": self._shuffle}

  def get_state(self) -> dict:
    """A JSON-serializable dict: the next step to yield plus the stream's identity."""
    return {"step": self._step, **self._identity()}

  def set_state(self, state: dict) -> None:
    """Continues from `state` so the next batches are those an uninterrupted run would yield."""
    self._step = restored_step(state, self._identity(), 'corpus')


def restored_step(state: dict, expected: dict, what: str) -> int:
  """The step a saved iterator state continues from, after checking that it was saved by the same
  stream (`expected`: its identity); DataError in one line naming the first difference."""
  for key, value in expected.items():
    if state.get(key) != value:
      raise DataError(f"data iterator state has {key}={state.get(key)!r} but this run has "
                      f"{key}={value!r}; a state resumes only the same {what}, seed and shapes")
  step = state.get("step")
  if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
    raise DataError(f"data iterator state has step={step!r}; it must be a non-negative integer")
  return int(step)


def eval_window_indices(num_windows: int, *, batch_size: int, eval_tokens: int,
                        seq_len: int) -> np.ndarray:
  """[batches, batch_size] window indices: enough whole batches for `eval_tokens` input tokens
  (all the split holds, if fewer), spread evenly over the split; row r holds a contiguous run."""
  if eval_tokens < 1:
    raise DataError(f"train.eval_tokens={eval_tokens!r} must be a positive integer")
  batches = min(-(-eval_tokens // (batch_size * seq_len)), num_windows // batch_size)
  if batches < 1:
    raise DataError(f"the validation split has {num_windows} windows of seq_len={seq_len}; one "
                    f"evaluation batch needs batch_size={batch_size}: use a smaller batch, a "
                    "larger data.val_fraction or more data")
  count = batches * batch_size
  spread = np.arange(count, dtype=np.int64) * num_windows // count
  return spread.reshape(batch_size, batches).T


def eval_batches(windows: Windows, *, batch_size: int, eval_tokens: int, process_index: int = 0,
                 process_count: int = 1) -> dict:
  """This process's rows of the evaluation set: {'inputs', 'targets', 'segments'}, each int32
  [batches, batch_size / process_count, seq_len]."""
  rows = check_sharding(batch_size, process_index, process_count, "train.batch_size")
  indices = eval_window_indices(windows.num_windows, batch_size=batch_size,
                                eval_tokens=eval_tokens, seq_len=windows.seq_len)
  mine = indices[:, process_index * rows:(process_index + 1) * rows]
  gathered = windows.gather(mine.T.reshape(-1))   # row by row: each row's run is contiguous
  return {k: v.reshape(rows, mine.shape[0], -1).swapaxes(0, 1) for k, v in gathered.items()}
