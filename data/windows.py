"""How a token array is cut into training windows: counting them and gathering a batch of them.

Window i is tokens[i*seq_len : i*seq_len + seq_len + 1]. Windows start every seq_len tokens and
are seq_len + 1 long, so consecutive windows share one token and every token is a target once.
"""

import numpy as np

from data.corpus import DataError


def count_windows(tokens: np.ndarray, seq_len: int) -> int:
  """Number of whole windows in `tokens`; a DataError if there is not even one."""
  if seq_len < 1:
    raise DataError(f"seq_len={seq_len!r} must be a positive integer")
  if tokens.ndim != 1:
    raise DataError(f"tokens must be a 1-D array of token ids, got shape {tokens.shape}")
  num_windows = (len(tokens) - 1) // seq_len
  if num_windows < 1:
    raise DataError(f"the corpus has {len(tokens)} tokens; one sequence of seq_len={seq_len} "
                    f"needs {seq_len + 1} (inputs plus the shifted target)")
  return num_windows


def gather_windows(tokens: np.ndarray, window_indices: np.ndarray, seq_len: int) -> dict:
  """{'inputs', 'targets'}: int32 [len(window_indices), seq_len], targets shifted by one."""
  starts = np.asarray(window_indices, dtype=np.int64) * seq_len
  windows = tokens[starts[:, None] + np.arange(seq_len + 1)].astype(np.int32)
  return {"inputs": np.ascontiguousarray(windows[:, :-1]),
          "targets": np.ascontiguousarray(windows[:, 1:])}
