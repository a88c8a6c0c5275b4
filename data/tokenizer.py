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


class HFTokenizer:
  """A Hugging Face tokenizer (`tokenizer.json`, read by the `tokenizers` library), for fine-tuning
  an imported checkpoint on text in its own vocabulary. Text is decoded from UTF-8 (invalid bytes
  become U+FFFD) and encoded without special tokens; documents are joined as they are read."""

  def __init__(self, path: str):
    import os
    from tokenizers import Tokenizer
    file = os.path.join(path, 'tokenizer.json') if os.path.isdir(path) else path
    if not os.path.isfile(file):
      raise ValueError(f'data.tokenizer={path!r}: no tokenizer.json there; give a tokenizer.json '
                       f'file or a Hugging Face checkpoint directory holding one, or "bytes"')
    try:
      self._tokenizer = Tokenizer.from_file(file)
    except Exception as e:   # the library raises its own exception types for a bad file
      raise ValueError(f'data.tokenizer={path!r}: {file} is not a tokenizer.json ({e})') from None
    self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)

  def encode(self, text: str | bytes) -> np.ndarray:
    text = text if isinstance(text, str) else bytes(text).decode('utf-8', errors='replace')
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids)])


def make_tokenizer(spec: str):
  """`data.tokenizer`: 'bytes' (the default byte-level tokenizer) or a tokenizer.json path / a
  Hugging Face checkpoint directory holding one. ValueError in one line for a bad one."""
  return ByteTokenizer() if spec in ('', 'bytes') else HFTokenizer(spec)
