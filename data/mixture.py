"""Training on several sources in set proportions: `data.path=code=0.7:DIR1,prose=0.3:DIR2`.

Each source is what a `data.path` of its own may be (a prepared directory, or a glob prepared into
the run's cache), all with the same tokenizer; the weights need not sum to 1 (they are normalised).

Which source each row of a batch draws from is a pure function of (seed, step, row), so a run
resumes exactly, and on another number of processes, from the step alone. Rows are dealt in
periods of PERIOD rows (in global row order, step after step): a period holds each source's
share of the rows, its weight x PERIOD rounded by largest remainders, in an order shuffled per
period. So over any whole period the proportions are exact to 1/PERIOD, and within one they drift
by no more than a shuffled deck's. A source's rows read its own windows (data/windows.py) in an
order shuffled afresh every epoch of that source: a small source repeats sooner than a large one,
as its weight asks.

Evaluation reads each source's validation split apart (train/validation.py reports a loss per
source, and their weighted mean).
"""
import functools
import re
from typing import NamedTuple

import grain
import numpy as np

from data.corpus import DataError
from data.pipeline import ENDLESS, check_sharding, restored_step, stream_seed
from data.windows import Windows

PERIOD = 4096   # rows per period of the deal
_ENTRY = re.compile(r'^([A-Za-z0-9_-]+)=([0-9.eE+-]+):(.+)$')


class Component(NamedTuple):
  name: str
  weight: float   # normalised: the weights sum to 1
  path: str


def parse(path: str) -> list[Component] | None:
  """The sources of a mixture `data.path` (NAME=WEIGHT:PATH, comma-separated), or None when `path`
  is a single source. DataError in one line for a malformed mixture."""
  entries = path.split(',')
  matches = [_ENTRY.match(entry.strip()) for entry in entries]
  if not any(matches):
    return None
  if not all(matches):
    bad = entries[matches.index(None)]
    raise DataError(f'data.path={path!r}: {bad!r} is not NAME=WEIGHT:PATH; a mixture is written '
                    'as code=0.7:DIR1,prose=0.3:DIR2 (names of letters, digits, _ and -)')
  names = [m[1] for m in matches]
  if len(set(names)) < len(names):
    raise DataError(f'data.path={path!r} names a source twice; give each a name of its own')
  try:
    weights = [float(m[2]) for m in matches]
  except ValueError:
    weights = []
  if len(weights) < len(names) or not all(np.isfinite(w) and w > 0 for w in weights):
    raise DataError(f'data.path={path!r}: every weight must be a positive number')
  total = sum(weights)
  return [Component(m[1], w / total, m[3].strip()) for m, w in zip(matches, weights)]


def shares(weights: list[float], rows: int = PERIOD) -> np.ndarray:
  """Each source's rows in a period: weight x rows, rounded by largest remainders (sum = rows)."""
  exact = np.asarray(weights, np.float64) * rows
  counts = np.floor(exact).astype(np.int64)
  left = rows - int(counts.sum())
  counts[np.argsort(-(exact - counts), kind='stable')[:left]] += 1
  return counts


class MixtureBatches:
  """Endless, checkpointable iterator of batches drawn from several sources (data/pipeline.py's
  TokenBatches' interface: the state is the step and what identifies the stream)."""

  def __init__(self, sources: list[tuple[str, float, Windows]], *, global_batch_size: int,
               seed: int, process_index: int = 0, process_count: int = 1):
    rows = check_sharding(global_batch_size, process_index, process_count, 'train.batch_size')
    self._names = [name for name, _, _ in sources]
    self._weights = [weight for _, weight, _ in sources]
    self._windows = [windows for _, _, windows in sources]
    self._shares = shares(self._weights)
    if (self._shares == 0).any():
      name = self._names[int(np.argmin(self._shares))]
      raise DataError(f'data.path: source {name!r} has too small a weight to get a row in '
                      f'{PERIOD}; give it at least {1 / PERIOD:.1e} of the total')
    self._global_batch_size, self._seed = global_batch_size, int(seed)
    self._rows = range(process_index * rows, (process_index + 1) * rows)
    self._orders = []
    for name, windows in zip(self._names, self._windows):
      order = grain.MapDataset.range(windows.num_windows).shuffle(
          seed=stream_seed('Mixture', seed, name))
      self._orders.append(order.repeat(num_epochs=ENDLESS // windows.num_windows))
    self._step = 0

  @property
  def num_windows(self) -> int:
    return sum(w.num_windows for w in self._windows)

  @property
  def tokens_per_batch(self) -> int:
    return self._global_batch_size * self._windows[0].seq_len

  @functools.lru_cache(maxsize=4)
  def _period(self, period: int) -> tuple[np.ndarray, np.ndarray]:
    """(source of each row of the period, how many rows of that source come before it in it)."""
    deal = np.repeat(np.arange(len(self._shares)), self._shares)
    rng = np.random.default_rng(stream_seed('Mixture', self._seed, 'period', period))
    deal = rng.permutation(deal)
    before = np.zeros(len(deal), np.int64)
    for source in range(len(self._shares)):
      mine = deal == source
      before[mine] = np.arange(int(mine.sum()))
    return deal, before

  def draws(self, step: int) -> list[tuple[int, int]]:
    """(source, its draw number) of each of this process's rows at `step`."""
    out = []
    for row in self._rows:
      g = step * self._global_batch_size + row
      period, place = divmod(g, PERIOD)
      deal, before = self._period(period)
      source = int(deal[place])
      out.append((source, period * int(self._shares[source]) + int(before[place])))
    return out

  def __iter__(self) -> 'MixtureBatches':
    return self

  def __next__(self) -> dict:
    draws = self.draws(self._step)
    self._step += 1
    rows: list[dict | None] = [None] * len(draws)
    for source, windows in enumerate(self._windows):
      mine = [i for i, (s, _) in enumerate(draws) if s == source]
      if mine:
        got = windows.gather([self._orders[source][draws[i][1]] for i in mine])
        for j, i in enumerate(mine):
          rows[i] = {k: v[j] for k, v in got.items()}
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

  def _identity(self) -> dict:
    return {'seed': self._seed, 'seq_len': self._windows[0].seq_len,
            'global_batch_size': self._global_batch_size, 'packing': self._windows[0].packing,
            'sources': [{'name': n, 'weight': w, 'num_tokens': int(win.shards.tokens.sum()),
                         'num_windows': win.num_windows}
                        for n, w, win in zip(self._names, self._weights, self._windows)]}

  def get_state(self) -> dict:
    return {'step': self._step, **self._identity()}

  def set_state(self, state: dict) -> None:
    self._step = restored_step(state, self._identity(), 'mixture')
