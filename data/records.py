"""What an input file holds, as documents, and the bad records among them: the formats that
`python -m data.prepare` and `python -m data.tokenizer` read, chosen by each file's extension.

  .jsonl, .jsonl.gz, .jsonl.zst   one JSON object per line; the document is its `text_field`
  .parquet                        one row per document; the document is its `text_field`
  anything else (.txt, .py, ...)  text: the whole file is one document, or with a document
                                  delimiter the pieces between delimiters (empty ones dropped)

`text_field` may be a dotted path (`meta.body`: the `body` of the object at `meta`).

Streamed, so memory is bounded by the largest document, not by the file: JSON Lines are read a line
at a time (through the gzip or zstd decompressor), Parquet a batch of rows of one row group at a
time, delimited text in blocks. An uncompressed JSON Lines file can be cut into byte ranges that
workers read in parallel: a range holds the lines that start in it.

Every document has a key, its place in the file (a line's byte offset, a row number, a delimited
document's ordinal), that does not depend on how the file was cut: data/prepare.py sends each
document to train or validation by a hash of its file and key.

A bad record (invalid JSON, a missing or non-string field, bytes that are not UTF-8, a NUL byte
under the byte tokenizer, a compressed stream cut short) goes to `BadRecords`: under `fail` it
raises a DataError naming the file, the line or row and the reason; under `skip` it is counted
per reason with its first few places.
"""
import gzip
import io
import json
import os
import re
import zlib
from typing import Callable, Iterator, NamedTuple

from data.corpus import DataError, Shard, split_files
from data.files import READ_BYTES

FORMATS = ('text', 'jsonl', 'jsonl.gz', 'jsonl.zst', 'parquet')
ON_BAD_RECORD = ('fail', 'skip')
# Places kept per reason under `skip`.
FIRST_PLACES = 5
PARQUET_ROWS = 1024   # rows decoded at once


def file_format(path: str) -> str:
  name = path.lower()
  for suffix in ('.jsonl.gz', '.jsonl.zst', '.jsonl', '.parquet'):
    if name.endswith(suffix):
      return suffix[1:]
  return 'text'


def cuttable(fmt: str) -> bool:
  """Whether a file of this format can be read in byte ranges by several workers: plain JSON Lines
  (the lines that start in the range) and Parquet (the row groups that start in it); a compressed
  stream is read from its start, one worker a file."""
  return fmt in ('jsonl', 'parquet')


def row_groups(path: str) -> int:
  """A Parquet file's row groups: the most pieces it can be cut into."""
  import pyarrow.parquet as pq
  return pq.ParquetFile(path).metadata.num_row_groups


class Reading(NamedTuple):
  """How documents are taken out of files (recorded in a preparation's plan)."""
  text_field: str = 'text'
  document_delimiter: str = ''   # '' = a text file is one document

  def check(self) -> 'Reading':
    if not self.text_field or any(not part for part in self.text_field.split('.')):
      raise DataError(f'--text_field={self.text_field!r}; give a field name such as text, or a '
                      'dotted path such as meta.body')
    return self

  def by_document(self, fmt: str) -> bool:
    """Whether a file of this format holds several documents (split one by one), rather than
    being one document."""
    return fmt != 'text' or bool(self.document_delimiter)


def parse_delimiter(text: str) -> str:
  r"""A delimiter as typed on a command line: the escapes \n, \r, \t and \\ are read as the
  characters they name ('\n\n': a blank line); anything else is taken as it is."""
  return re.sub(r'\\([nrt\\])', lambda m: {'n': '\n', 'r': '\r', 't': '\t', '\\': '\\'}[m[1]],
                text)


class BadRecords:
  """The bad records of one piece of work: counts per reason, and the first few places."""

  def __init__(self, on_bad_record: str = 'fail'):
    if on_bad_record not in ON_BAD_RECORD:
      raise DataError(f'--on_bad_record={on_bad_record!r}; allowed: {", ".join(ON_BAD_RECORD)}')
    self.on_bad_record = on_bad_record
    self.reasons: dict[str, dict] = {}

  def add(self, reason: str, place: str) -> None:
    if self.on_bad_record == 'fail':
      raise DataError(f'{place}: {reason}; fix or remove the record, or give '
                      '--on_bad_record=skip to skip bad records (each reason counted)')
    entry = self.reasons.setdefault(reason, {'count': 0, 'first': []})
    entry['count'] += 1
    if len(entry['first']) < FIRST_PLACES:
      entry['first'].append(place)

  def to_json(self) -> dict:
    return self.reasons


def merge_bad_records(records: list[dict]) -> dict:
  """The bad records of several pieces of work, as one: counts summed, first places in order."""
  merged: dict[str, dict] = {}
  for record in records:
    for reason, entry in sorted(record.items()):
      into = merged.setdefault(reason, {'count': 0, 'first': []})
      into['count'] += entry['count']
      into['first'] = (into['first'] + entry['first'])[:FIRST_PLACES]
  return merged


def describe_bad_records(bad: dict) -> str:
  """One line per reason: the count and the first place."""
  return '\n'.join(f'skipped     {e["count"]} record(s): {reason} (first: {e["first"][0]})'
                   for reason, e in sorted(bad.items()))


class Document(NamedTuple):
  key: str     # its place in the file, independent of how the file was cut
  text: str
  place: Callable[[], str]   # for messages: 'FILE line N', 'FILE row N', 'FILE document N'


def documents(path: str, fmt: str, reading: Reading, bad: BadRecords, start: int = 0,
              stop: int | None = None, name: str | None = None) -> Iterator[Document]:
  """The documents of a file that holds several (Reading.by_document), in file order, with bad
  records sent to `bad`. For an uncompressed JSON Lines file, [start, stop) is a byte range: its
  documents are the lines that start in it; for a Parquet file, the rows of the row groups that
  start in it. `name`: the file as messages give it."""
  name = name or path
  if fmt == 'parquet':
    yield from _parquet(path, reading, bad, name, start, stop)
  elif fmt.startswith('jsonl'):
    yield from _jsonl(path, fmt, reading, bad, start, stop, name)
  elif reading.document_delimiter:
    yield from _delimited(path, reading.document_delimiter, bad, name)
  else:
    raise ValueError(f'{name} is one document (format {fmt}, no delimiter)')


def _field(record: dict, text_field: str, place: Callable[[], str], bad: BadRecords) -> str | None:
  value = record
  for part in text_field.split('.'):
    if not isinstance(value, dict) or value.get(part) is None:
      bad.add(f'no field {text_field!r}', place())
      return None
    value = value[part]
  if not isinstance(value, str):
    bad.add(f'field {text_field!r} is a {type(value).__name__}, not a string', place())
    return None
  return value


def _open_stream(path: str, fmt: str):
  if fmt == 'jsonl.gz':
    return gzip.open(path, 'rb')
  if fmt == 'jsonl.zst':
    import zstandard
    return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, 'rb'),
                                                                        closefd=True))
  return open(path, 'rb')


def _zstd_error() -> type:
  import zstandard
  return zstandard.ZstdError


def _count_lines(path: str, offset: int) -> int:
  """Lines that end before byte `offset` of an uncompressed file (read only to name a bad
  record's line in a range that starts inside the file)."""
  count = 0
  with open(path, 'rb') as f:
    while offset > 0:
      block = f.read(min(READ_BYTES, offset))
      if not block:
        break
      count += block.count(b'\n')
      offset -= len(block)
  return count


def _jsonl(path, fmt, reading, bad, start, stop, name):
  lines_before = None if start else 0   # counted only if a message needs a line number
  first = 0   # the byte offset of the range's first line

  def place(line_in_range: int) -> str:
    nonlocal lines_before
    if lines_before is None:
      lines_before = _count_lines(path, first)
    return f'{name} line {lines_before + line_in_range}'

  with _open_stream(path, fmt) as f:
    offset = 0
    if start:
      f.seek(start - 1)
      offset = first = start - 1 + len(f.readline())   # the first line starting in the range
    line = 0   # in the range
    try:
      for data in f:
        if stop is not None and offset >= stop:
          break
        line_offset, offset, line = offset, offset + len(data), line + 1
        if not data.strip():
          continue
        try:
          record = json.loads(data)
        except UnicodeDecodeError:
          bad.add('bytes that are not UTF-8', place(line))
          continue
        except ValueError as e:
          bad.add(f'invalid JSON ({e.args[0].split(":")[0]})', place(line))
          continue
        if not isinstance(record, dict):
          bad.add(f'a JSON {type(record).__name__}, not an object', place(line))
          continue
        text = _field(record, reading.text_field, lambda: place(line), bad)
        if text is not None:
          yield Document(str(line_offset), text, lambda line=line: place(line))
    except DataError:
      raise
    except Exception as e:   # a cut or damaged compressed stream (gzip, zlib and zstd errors)
      if fmt == 'jsonl' or not isinstance(e, (EOFError, OSError, ValueError, zlib.error, _zstd_error())):
        raise
      bad.add(f'the compressed stream is cut short or damaged ({type(e).__name__}: {e})',
              f'{name} after line {line}')


def _parquet(path, reading, bad, name, start=0, stop=None):
  import pyarrow.parquet as pq
  top = reading.text_field.split('.')[0]
  try:
    file = pq.ParquetFile(path)
  except Exception as e:   # pyarrow raises its own types for a file that is not Parquet
    raise DataError(f'{name} is not a Parquet file ({e})') from None
  columns = file.schema_arrow.names
  if top not in columns:
    raise DataError(f'{name} has no column {top!r} (--text_field={reading.text_field!r}); its '
                    f'columns: {", ".join(columns)}')
  # The row groups that start in [start, stop), each with the rows before it in the file (a row's
  # key is its number in the file, whatever the cut).
  meta, first_row = file.metadata, 0
  for i in range(meta.num_row_groups):
    group = meta.row_group(i)
    chunk = group.column(0)
    offset = min(o for o in (chunk.dictionary_page_offset, chunk.data_page_offset) if o)
    row, first_row = first_row, first_row + group.num_rows
    if offset < start or (stop is not None and offset >= stop):
      continue
    for batch in file.iter_batches(batch_size=PARQUET_ROWS, columns=[top], row_groups=[i]):
      for value in batch.column(0).to_pylist():
        place = lambda row=row: f'{name} row {row}'
        text = _field({top: value}, reading.text_field, place, bad)
        if text is not None:
          yield Document(str(row), text, place)
        row += 1


def _delimited(path, delimiter, bad, name):
  separator = delimiter.encode('utf-8')
  ordinal, carry = 0, b''

  def document(data: bytes):
    nonlocal ordinal
    ordinal += 1
    place = lambda ordinal=ordinal: f'{name} document {ordinal}'
    try:
      text = data.decode('utf-8')
    except UnicodeDecodeError as e:
      bad.add(f'bytes that are not UTF-8 (at byte {e.start} of the document)', place())
      return None
    return Document(str(ordinal), text, place) if text.strip() else None

  with open(path, 'rb') as f:
    for block in iter(lambda: f.read(READ_BYTES), b''):
      parts = (carry + block).split(separator)
      carry = parts.pop()
      for part in parts:
        if (doc := document(part)) is not None:
          yield doc
  if (doc := document(carry)) is not None:
    yield doc


def text_blocks(path: str, start: int, stop: int, cut_at_newline: bool) -> Iterator[bytes]:
  """The bytes [start, stop) of a file in blocks of about READ_BYTES. `cut_at_newline`: blocks
  end after a newline (for a BPE tokenizer: its tokens do not span lines; a line longer than a
  block is cut where the block ends); else anywhere (the byte tokenizer)."""
  carry = b''
  with open(path, 'rb') as f:
    f.seek(start)
    left = stop - start
    while left > 0 or carry:
      block = f.read(min(READ_BYTES, left)) if left > 0 else b''
      left -= len(block)
      data = carry + block
      carry = b''
      if cut_at_newline and left > 0:
        end = data.rfind(b'\n') + 1
        if 0 < end < len(data):
          data, carry = data[:end], data[end:]
      if data:
        yield data


def check_parquet_columns(paths: list[str], reading: Reading, root: str) -> None:
  """DataError in one line for a Parquet input without the text field's column (every row would
  be bad: that is a wrong --text_field, not bad records)."""
  if not paths:   # importing pyarrow: 0.1 s warm, most of a second cold
    return
  import pyarrow.parquet as pq
  top = reading.text_field.split('.')[0]
  for path in paths:
    try:
      names = pq.read_schema(path).names
    except Exception as e:
      raise DataError(f'{os.path.relpath(path, root)} is not a Parquet file ({e})') from None
    if top not in names:
      raise DataError(f'{path} has no column {top!r} (--text_field={reading.text_field!r}); its '
                      f'columns: {", ".join(names)}')


def whole_file_sides(root: str, files: list[str], reading: Reading,
                     val_fraction: float) -> tuple[list[Shard], list[Shard]]:
  """The files of `files` that are one document each (text files without a delimiter), split into
  (train, validation) shards (data/corpus.py:split_files): whole by their path's hash, or each cut
  by bytes where that leaves a side empty. `val_fraction` 0: every one trains, whole."""
  whole = [p for p in files if not reading.by_document(file_format(p))]
  if not whole or val_fraction == 0:
    return [Shard(p) for p in whole], []
  return split_files(root, whole, val_fraction)
