"""The byte-level tokenizer: token id = byte value, so any file or string round-trips exactly.

No vocabulary file, no training, no unknown tokens: the simplest tokenizer that can never
lose data, and the one every corpus in this project is encoded with today.
"""

import numpy as np


class ByteTokenizer:
  """Maps bytes to ids 0..255 and back; str is encoded as UTF-8."""

  vocab_size = 256

  def encode(self, text: str | bytes) -> np.ndarray:
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    # frombuffer views the immutable bytes; copy so callers get an ordinary writable array.
    return np.frombuffer(data, dtype=np.uint8).copy()

  def decode_bytes(self, ids) -> bytes:
    ids = np.asarray(ids)
    if ids.size and (ids.min() < 0 or ids.max() >= self.vocab_size):
      # A model whose vocab is padded past 256 can sample such ids; say so rather than wrap.
      bad = ids[(ids < 0) | (ids >= self.vocab_size)].flat[0]
      raise ValueError(f"token id {int(bad)} is not a byte; ByteTokenizer ids are 0..255")
    return ids.astype(np.uint8).tobytes()

  def decode(self, ids) -> str:
    # Sampled byte sequences need not be valid UTF-8; show U+FFFD instead of failing.
    return self.decode_bytes(ids).decode("utf-8", errors="replace")
