"""Training on several sources in set proportions: `data.path=code=0.7:DIR1,prose=0.3:DIR2`.

Each source is what a `data.path` of its own may be (a prepared directory, or a glob prepared into
the run's cache), all with the same tokenizer; the weights need not sum to 1 (they are normalised).

Which source each row of a batch draws from is a pure function of (seed, step, row), so a run
resumes exactly, and on another number of processes, from the step alone. The deal runs in
periods of PERIOD steps (steps k x PERIOD to (k + 1) x PERIOD - 1), each with one deck of PERIOD
places, each source's share of them (its weight x PERIOD, rounded by largest remainders) in an
order shuffled per period. Row r of B reads the deck from place r x PERIOD // B on, one place a
step, round the deck. So each row draws every source its exact share in each period, and a step's
rows read B places spread evenly over the deck: when B divides PERIOD, each PERIOD / B steps of a
period read the whole deck once, and the proportions are exact over those PERIOD rows; within them
they drift by no more than a shuffled deck's. (With B > PERIOD rows share starting places, and so
their sources, step after step; they still read different windows, from their own lanes.)

A row reads each source as a single source's row reads it (data/pipeline.py): row r draws from
its own lane of the source (the r-th of B contiguous ranges of its windows), in an order shuffled
afresh every epoch of the lane, so a process reads only its rows' lanes, its 1/P of every source's
shards. A small source repeats sooner than a large one, as its weight asks.

Evaluation reads each source's validation split apart (train/validation.py reports a loss per
source, and their weighted mean).
"""
import functools
import re
from typing import NamedTuple

import numpy as np

from data.corpus import DataError
from data.pipeline import check_sharding, lane_orders, restored_step, stream_seed
from data.windows import Windows

PERIOD = 4096   # steps per period of the deal, and places in its deck
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
  """Each source's places in a deck of `rows`: weight x rows, rounded by largest remainders
  (sum = rows)."""
  exact = np.asarray(weights, np.float64) * rows
  counts = np.floor(exact).astype(np.int64)
  left = rows - int(counts.sum())
  counts[np.argsort(-(exact - counts), kind='stable')[:left]] += 1
  return counts


class MixtureBatches:
  """Endless, checkpointable iterator of batches drawn from several sources (data/pipeline.py's
  TokenBatches' interface: the state is the step and what identifies the stream)."""

  DEAL = 'rows'   # in the state: a mixture's deal before rows read their own lanes had none

  def __init__(self, sources: list[tuple[str, float, Windows]], *, global_batch_size: int,
               seed: int, process_index: int = 0, process_count: int = 1):
    rows = check_sharding(global_batch_size, process_index, process_count, 'train.batch_size')
    self._names = [name for name, _, _ in sources]
    self._weights = [weight for _, weight, _ in sources]
    self._windows = [windows for _, _, windows in sources]
    self._shares = shares(self._weights)
    if (self._shares == 0).any():
      name = self._names[int(np.argmin(self._shares))]
      raise DataError(f'data.path: source {name!r} has too small a weight to get a place in the '
                      f'deck of {PERIOD} (each row draws each place once every {PERIOD} steps); '
                      f'give it at least {1 / PERIOD:.1e} of the total')
    self._global_batch_size, self._seed = global_batch_size, int(seed)
    self._rows = range(process_index * rows, (process_index + 1) * rows)
    self._orders = []   # [source][this process's row]: the row's lane of the source
    for name, windows in zip(self._names, self._windows):
      try:
        self._orders.append(lane_orders(windows, self._rows, global_batch_size,
                                        ('Mixture', self._seed, name)))
      except DataError as e:
        raise DataError(f'data.path source {name!r}: {e}') from None
    self._step = 0

  @property
  def num_windows(self) -> int:
    return sum(w.num_windows for w in self._windows)

  @property
  def tokens_per_batch(self) -> int:
    return self._global_batch_size * self._windows[0].seq_len

  @functools.lru_cache(maxsize=2)
  def _deck(self, period: int) -> tuple[np.ndarray, np.ndarray]:
    """(the source of each place of the period's deck, read twice round; [source, place]: how
    many places of that source come before the place in it)."""
    deck = np.repeat(np.arange(len(self._shares)), self._shares)
    rng = np.random.default_rng(stream_seed('Mixture', self._seed, 'period', period))
    twice = np.tile(rng.permutation(deck), 2)
    before = np.zeros((len(self._shares), len(twice) + 1), np.int64)
    before[:, 1:] = np.cumsum(twice == np.arange(len(self._shares))[:, None], axis=1)
    return twice, before

  def draws(self, step: int) -> list[tuple[int, int]]:
    """(source, the row's draw number from its lane of it) of each of this process's rows."""
    period, place = divmod(step, PERIOD)
    deck, before = self._deck(period)
    out = []
    for row in self._rows:
      start = row * PERIOD // self._global_batch_size
      source = int(deck[start + place])
      drawn = int(before[source, start + place] - before[source, start])
      out.append((source, period * int(self._shares[source]) + drawn))
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
        got = windows.gather([self._orders[source][i][draws[i][1]] for i in mine])
        for j, i in enumerate(mine):
          rows[i] = {k: v[j] for k, v in got.items()}
    return {k: np.stack([row[k] for row in rows]) for k in rows[0]}

  def _identity(self) -> dict:
    return {'seed': self._seed, 'seq_len': self._windows[0].seq_len,
            'global_batch_size': self._global_batch_size, 'packing': self._windows[0].packing,
            'sources': [{'name': n, 'weight': w, 'num_tokens': int(win.shards.tokens.sum()),
                         'num_windows': win.num_windows}
                        for n, w, win in zip(self._names, self._weights, self._windows)],
            'deal': self.DEAL}   # last: a single source's state differs first by its sources

  def get_state(self) -> dict:
    return {'step': self._step, **self._identity()}

  def set_state(self, state: dict) -> None:
    if 'sources' in state and 'deal' not in state:
      raise DataError(
          f'the checkpoint\'s data position (step {state.get("step")}) was saved by an earlier '
          'version\'s mixture, whose rows drew from every shard of a source; this version\'s '
          'rows draw from their own lanes and do not continue it: go on from its weights in a new '
          '--workdir with --config.init_from=run:<the workdir just given>')
    self._step = restored_step(state, self._identity(), 'mixture')
