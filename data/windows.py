"""How a split's shards are cut into training windows, and reading a batch of them.

A window is seq_len + 1 consecutive tokens of one shard (windows never cross shards): inputs are
its first seq_len, targets its last seq_len. Every batch carries `segments` [rows, seq_len] beside
them: 0 for padding, k >= 1 for the k-th document in the row. A target < 0 is not predicted.

- packed (`data.packing=True`, the default): shard tokens [k * seq_len, k * seq_len + seq_len + 1)
  for k = 0, 1, ...; documents follow each other in a row, and the batch's `segments`
  [rows, seq_len] (k >= 1 for the k-th document of the row) keep them apart in the model
  (attention never crosses one, positions restart at each). A target that is the first
  token of the next document is not predicted (it is the next document's bos, or its first token).
- unpacked: every window holds one piece of one document, pieces starting every seq_len tokens;
  a short piece is padded (segment 0, targets not predicted).
"""
import numpy as np

from data.corpus import DataError
from data.shards import SplitShards

IGNORED = -1   # the target of a position that predicts nothing


def batch_keys(packing: bool) -> tuple[str, ...]:
  """The arrays of a batch. Unpacked rows hold one document each, padded at the end, which the
  causal mask already hides from every real position: they need no segments."""
  return ('inputs', 'targets', 'segments') if packing else ('inputs', 'targets')


class Windows:
  """The windows of one split. `gather(window_indices)` reads a batch of them."""

  def __init__(self, shards: SplitShards, seq_len: int, packing: bool):
    if seq_len < 1:
      raise DataError(f'train.seq_len={seq_len!r} must be a positive integer')
    self.shards, self.seq_len, self.packing = shards, seq_len, bool(packing)
    if self.packing:
      counts = np.maximum(shards.tokens - 1, 0) // seq_len
    else:   # a document of n tokens gives ceil((n - 1) / seq_len) pieces (from its index only)
      counts = np.asarray([self._pieces(shards.document_lengths(s)).sum()
                           for s in range(len(shards))], np.int64)
    self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    self.num_windows = int(self.starts[-1])
    if self.num_windows < 1:
      longest = int(shards.tokens.max(initial=0))
      raise DataError(f'the {shards.split} split has no window of train.seq_len={seq_len}: a window '
                      f'needs seq_len + 1 = {seq_len + 1} tokens of one shard, and its largest shard '
                      f'holds {longest}; use a shorter seq_len or more data')
    self._piece_starts: dict[int, np.ndarray] = {}

  def open_windows(self, low: int, high: int) -> None:
    """Opens (and checks against the index) the shards that windows [low, high) lie in."""
    first = int(np.searchsorted(self.starts, low, side='right') - 1)
    last = int(np.searchsorted(self.starts, high - 1, side='right') - 1)
    for shard in range(first, last + 1):
      self.shards.shard_tokens(shard)

  def _pieces(self, lengths: np.ndarray) -> np.ndarray:
    return -(-(np.asarray(lengths, np.int64) - 1) // self.seq_len)

  def gather(self, window_indices) -> dict:
    """{'inputs', 'targets'(, 'segments')}: int32 [len(window_indices), seq_len]."""
    window_indices = np.asarray(window_indices, np.int64)
    if window_indices.size and (window_indices.min() < 0 or window_indices.max() >= self.num_windows):
      raise IndexError(f'window indices must be in [0, {self.num_windows})')
    shard = np.searchsorted(self.starts, window_indices, side='right') - 1
    rows = [(self._packed if self.packing else self._piece)(int(s), int(w - self.starts[s]))
            for s, w in zip(shard, window_indices)]
    return {key: np.stack([row[i] for row in rows]) for i, key in
            enumerate(batch_keys(self.packing))}

  def _packed(self, shard: int, k: int):
    L = self.seq_len
    tokens = np.asarray(self.shards.shard_tokens(shard)[k * L:k * L + L + 1], np.int32)
    documents = np.searchsorted(self.shards.document_starts(shard), k * L + np.arange(L + 1),
                                side='right')
    segments = (documents - documents[0] + 1).astype(np.int32)
    targets = np.where(segments[1:] == segments[:-1], tokens[1:], IGNORED).astype(np.int32)
    return tokens[:-1], targets, segments[:-1]

  def _piece(self, shard: int, k: int):
    L = self.seq_len
    if shard not in self._piece_starts:   # where each document's pieces start, for this shard
      lengths = self.shards.document_lengths(shard)
      self._piece_starts[shard] = np.concatenate([[0], np.cumsum(self._pieces(lengths))])
    piece_starts = self._piece_starts[shard]
    doc = int(np.searchsorted(piece_starts, k, side='right') - 1)
    starts = self.shards.document_starts(shard)
    end = int(starts[doc + 1]) if doc + 1 < len(starts) else len(self.shards.shard_tokens(shard))
    begin = int(starts[doc]) + (k - int(piece_starts[doc])) * L
    piece = np.asarray(self.shards.shard_tokens(shard)[begin:min(begin + L + 1, end)], np.int32)
    n = len(piece) - 1   # positions that predict a token
    tokens = np.zeros(L + 1, np.int32)
    tokens[:n + 1] = piece
    real = np.arange(L) < n
    return tokens[:-1], np.where(real, tokens[1:], IGNORED).astype(np.int32)
