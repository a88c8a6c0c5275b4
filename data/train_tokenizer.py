"""Training a byte-level BPE tokenizer on your own corpus (`python -m data.tokenizer`):

  python -m data.tokenizer --input='corpus/*.jsonl.gz' --vocab_size=32000 --out=tokenizer/

It reads the formats, fields and delimiters that `python -m data.prepare` reads (data/records.py),
with the same handling of bad records, and trains with the Hugging Face `tokenizers` library: the
GPT-2 pre-tokenizer (words, numbers and punctuation split apart, every byte mapped to a symbol, so
any text encodes and decodes exactly) and BPE merges up to `--vocab_size` tokens, two of them the
document markers `<|begin_of_text|>` and `<|end_of_text|>`. It writes `tokenizer.json` and, for
the markers, `tokenizer_config.json` into `--out`; `--tokenizer=DIR` (data.prepare) and
`data.tokenizer=DIR` (a run) then use it, and a run's model takes its vocabulary from it (padded
to a multiple of 128: train/checks.py).

Whole text files are read in blocks cut after a newline (BPE tokens never span one); `--max_mb`
stops after that much input (in path order), for a corpus larger than a tokenizer needs.

It trains on the training side only: the documents that `python -m data.prepare` with the same
`--val_fraction` (default 0.05, as there) holds out for validation are left out, the same files,
records and byte ranges (data/corpus.py's split), so validation text is unseen by the tokenizer as
by the model; `--val_fraction=0` trains on every document.
"""
import argparse
import os
import sys
import time

from data.corpus import VAL_FRACTION, DataError, held_out, list_files
from data.files import write_atomic, write_json
from data.records import (ON_BAD_RECORD, BadRecords, Reading, check_parquet_columns,
                          describe_bad_records, documents, file_format, parse_delimiter,
                          text_blocks, whole_file_sides)

BOS, EOS = '<|begin_of_text|>', '<|end_of_text|>'
MIN_VOCAB = 256 + 2   # every byte, and the two markers


def corpus_texts(pattern: str, reading: Reading, bad: BadRecords, max_bytes: int | None = None,
                 val_fraction: float = 0.0):
  """The corpus's training documents as strings (a whole text file, or its training part, in
  newline-cut blocks), in path order, until `max_bytes` of UTF-8 have been given; those that
  data.prepare holds out at `val_fraction` are left out. Yields (text, its UTF-8 bytes)."""
  root, files = list_files(pattern)
  check_parquet_columns([p for p in files if file_format(p) == 'parquet'], reading, root)
  trains = {shard.path: shard for shard in whole_file_sides(root, files, reading, val_fraction)[0]}
  given = 0
  for path in files:
    fmt = file_format(path)
    if reading.by_document(fmt):
      rel = os.path.relpath(path, root)
      texts = (doc.text for doc in documents(path, fmt, reading, bad)
               if not held_out(f'{rel}:{doc.key}', val_fraction))
    elif path in trains:
      start, stop = trains[path].byte_range(os.path.getsize(path))
      texts = (block.decode('utf-8', errors='replace')
               for block in text_blocks(path, start, stop, cut_at_newline=True))
    else:   # a whole file held out
      continue
    for text in texts:
      size = len(text.encode('utf-8', errors='replace'))
      yield text, size
      given += size
      if max_bytes is not None and given >= max_bytes:
        return


def train(pattern: str, vocab_size: int, out: str, *, reading: Reading = Reading(),
          on_bad_record: str = 'fail', max_mb: float | None = None,
          val_fraction: float = VAL_FRACTION, progress: bool = True) -> dict:
  """Trains the tokenizer on the training side of the corpus at `val_fraction` and writes it into
  `out` (new or empty); returns a summary."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  if not isinstance(vocab_size, int) or vocab_size < MIN_VOCAB:
    raise DataError(f'--vocab_size={vocab_size!r}; it must be at least {MIN_VOCAB} (every byte '
                    'and the two document markers)')
  if not (val_fraction == 0 or 0 < val_fraction <= 0.5):
    raise DataError(f'--val_fraction={val_fraction!r} must be in (0, 0.5] as data.prepare takes it, '
                    'or 0 to train on every document')
  if max_mb is not None and not max_mb > 0:
    raise DataError(f'--max_mb={max_mb!r} must be a positive number of MB (or left out: all)')
  if os.path.isdir(out) and os.listdir(out):
    raise DataError(f'--out={out!r} is not empty; give a new or empty directory, nothing there '
                    'is overwritten')
  reading.check()
  bad = BadRecords(on_bad_record)
  list_files(pattern)   # a glob that matches nothing is refused before anything is written
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=[BOS, EOS],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                show_progress=progress)
  seen = {'documents': 0, 'bytes': 0}

  def texts():
    for text, size in corpus_texts(pattern, reading, bad,
                                   None if max_mb is None else int(max_mb * 1e6), val_fraction):
      seen['documents'] += 1
      seen['bytes'] += size
      yield text

  started = time.perf_counter()
  tokenizer.train_from_iterator(texts(), trainer=trainer)
  seconds = time.perf_counter() - started
  os.makedirs(out, exist_ok=True)
  write_atomic(os.path.join(out, 'tokenizer.json'),
               lambda f: f.write(tokenizer.to_str().encode('utf-8')))
  write_json(os.path.join(out, 'tokenizer_config.json'),
             {'bos_token': BOS, 'eos_token': EOS, 'model_max_length': None,
              'tokenizer_class': 'PreTrainedTokenizerFast'})
  return {'vocab_size': tokenizer.get_vocab_size(with_added_tokens=True), 'seconds': seconds,
          'bad_records': bad.to_json(), 'val_fraction': val_fraction, **seen}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m data.tokenizer',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--input', required=True,
                      help="a glob of .jsonl(.gz/.zst), .parquet or text files; '' = the "
                      'embedded stdlib corpus')
  parser.add_argument('--vocab_size', type=int, required=True,
                      help=f'tokens, the two markers included (at least {MIN_VOCAB})')
  parser.add_argument('--out', required=True, help='a new or empty directory')
  parser.add_argument('--text_field', default='text')
  parser.add_argument('--document_delimiter', default='')
  parser.add_argument('--on_bad_record', default='fail', choices=ON_BAD_RECORD)
  parser.add_argument('--val_fraction', type=float, default=VAL_FRACTION,
                      help="the documents data.prepare's --val_fraction holds out are left out "
                      '(0: train on every document)')
  parser.add_argument('--max_mb', type=float, default=None,
                      help='train on the first MB of input only (default: all of it)')
  args = parser.parse_args(argv)
  try:
    summary = train(args.input, args.vocab_size, args.out,
                    reading=Reading(args.text_field, parse_delimiter(args.document_delimiter)),
                    on_bad_record=args.on_bad_record, max_mb=args.max_mb,
                    val_fraction=args.val_fraction)
  except DataError as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  held = (f', the validation side (--val_fraction={args.val_fraction:g}) left out'
          if args.val_fraction else '')
  print(f'tokenizer   {summary["vocab_size"]:,} tokens trained on {summary["documents"]:,} '
        f'documents, {summary["bytes"] / 1e6:.1f} MB{held}, in {summary["seconds"]:.1f} s: '
        f'{os.path.join(args.out, "tokenizer.json")}')
  if summary['bad_records']:
    print(describe_bad_records(summary['bad_records']))
  return 0
