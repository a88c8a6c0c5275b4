"""Tokenizers: bytes (token id = byte value, so any file round-trips exactly) or a Hugging Face
`tokenizer.json`; each with the ids that mark where a document begins and ends, and an identity
that prepared shards record (data/prepare.py) so that they are never read with another tokenizer.

Document markers: a prepared document is stored as [bos] + its tokens + [eos]. The byte tokenizer
has no spare id below 256 (the byte presets' vocabulary), so it marks both ends with id 0, the NUL
byte, which text never contains; preparing a file that holds a NUL byte is refused. A Hugging Face
tokenizer uses the `bos_token` / `eos_token` of the `tokenizer_config.json` beside it; a tokenizer
without them marks nothing (documents are still kept apart by segment ids when packed).

`python -m data.tokenizer --input=GLOB --vocab_size=N --out=DIR` trains a byte-level BPE on a corpus
(data/train_tokenizer.py).
"""
import hashlib
import json
import os

import numpy as np

# The byte tokenizer's document marker (both ends): the NUL byte.
BYTE_SEPARATOR = 0


class ByteTokenizer:
  """Maps bytes to ids 0..255 and back; str is encoded as UTF-8."""

  vocab_size = 256
  bos_id = eos_id = BYTE_SEPARATOR

  def identity(self) -> dict:
    """What prepared shards record of the tokenizer that made them."""
    return {'name': 'bytes', 'vocab_size': self.vocab_size, 'sha256': '',
            'bos_id': self.bos_id, 'eos_id': self.eos_id}

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
  become U+FFFD) and encoded without special tokens (the document markers are added around each
  document by the preparation)."""

  def __init__(self, path: str):
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
    with open(file, 'rb') as f:
      self._sha256 = hashlib.sha256(f.read()).hexdigest()
    self.bos_id, self.eos_id = self._special_ids(os.path.dirname(file))

  def _special_ids(self, directory: str) -> tuple[int | None, int | None]:
    """bos and eos ids from the tokenizer_config.json beside tokenizer.json (None where absent)."""
    path = os.path.join(directory, 'tokenizer_config.json')
    if not os.path.isfile(path):
      return None, None
    with open(path, encoding='utf-8') as f:
      special = json.load(f)
    def token_id(key):
      token = special.get(key)
      token = token.get('content') if isinstance(token, dict) else token
      return None if token is None else self._tokenizer.token_to_id(token)
    return token_id('bos_token'), token_id('eos_token')

  def identity(self) -> dict:
    return {'name': 'tokenizer.json', 'vocab_size': self.vocab_size, 'sha256': self._sha256,
            'bos_id': self.bos_id, 'eos_id': self.eos_id}

  def encode(self, text: str | bytes) -> np.ndarray:
    text = text if isinstance(text, str) else bytes(text).decode('utf-8', errors='replace')
    return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

  def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
    """Several documents at once (the library tokenizes them in parallel threads)."""
    return [np.asarray(e.ids, np.int32)
            for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

  def decode(self, ids) -> str:
    return self._tokenizer.decode([int(i) for i in np.asarray(ids)])


def make_tokenizer(spec: str):
  """`data.tokenizer`: 'bytes' (the default byte-level tokenizer) or a tokenizer.json path / a
  Hugging Face checkpoint directory holding one. ValueError in one line for a bad one."""
  return ByteTokenizer() if spec in ('', 'bytes') else HFTokenizer(spec)


if __name__ == '__main__':   # python -m data.tokenizer: trains one on a corpus
  import sys
  from data.train_tokenizer import main
  sys.exit(main())
