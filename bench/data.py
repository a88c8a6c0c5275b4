"""The data pipeline's costs: preparation throughput, loader throughput, per-process memory against
corpus size.

  python -m bench.data prepare [--tokenizer=bytes|bpe] [--workers=1,2]   # MB of input per second
  python -m bench.data loader [--batch_size=16 --seq_len=128]             # tokens per second read
  python -m bench.data memory [--sizes_mb=30,300,3000]                    # peak RSS per corpus size

`prepare` runs `data.prepare` on the embedded corpus (31.5 MB of the standard library's source) cut
into groups of 4 MiB, with the byte tokenizer or a 4096-token byte-level BPE trained here on a slice
of the same corpus (`--tokenizer=bpe`), once per worker count. `loader` reads batches from
the prepared corpus through `TokenBatches`, as a training process does, packed and unpacked.
`memory` writes corpora of the given sizes in token bytes (text repeated from the standard
library under distinct names, prepared with the byte tokenizer), then in a fresh process per size
opens the training batches and reads 200 of them, and reports the process's resident memory:
private (anonymous) before and after, file-backed (the mapped shards' pages) after, and the peak.
Everything is written under --scratch (default a temporary directory) and removed afterwards.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

from data import PreparedData, TokenBatches, Windows
from data.corpus import list_files
from data.prepare import prepare


def _bpe_tokenizer(directory: str) -> str:
  """A 4096-token byte-level BPE trained on 4 MB of the corpus; returns its tokenizer.json."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  _, files = list_files('')
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  texts, size = [], 0
  for path in files[::7]:
    with open(path, encoding='utf-8', errors='replace') as f:
      texts.append(f.read())
    size += len(texts[-1])
    if size > 4e6:
      break
  tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
      vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  path = os.path.join(directory, 'tokenizer.json')
  tokenizer.save(path)
  return path


def bench_prepare(scratch: str, tokenizer: str, workers: list[int]) -> list[dict]:
  spec = _bpe_tokenizer(scratch) if tokenizer == 'bpe' else 'bytes'
  rows = []
  for n in workers:
    out = os.path.join(scratch, f'prepared-{tokenizer}-{n}')
    started = time.perf_counter()
    index = prepare('', spec, out, workers=n, shard_mb=4, progress=False)
    seconds = time.perf_counter() - started
    size = sum(s['bytes'] for s in index['splits'].values())
    tokens = sum(s['tokens'] for s in index['splits'].values())
    rows.append({'tokenizer': tokenizer, 'workers': n, 'input_mb': size / 1e6, 'tokens': tokens,
                 'seconds': seconds, 'mb_per_s': size / 1e6 / seconds})
    shutil.rmtree(out)
  return rows


def bench_loader(scratch: str, batch_size: int, seq_len: int, steps: int) -> list[dict]:
  out = os.path.join(scratch, 'prepared-loader')
  prepare('', 'bytes', out, progress=False)
  rows = []
  for packing in (True, False):
    windows = Windows(PreparedData(out).split('train'), seq_len, packing)
    batches = TokenBatches(windows, global_batch_size=batch_size, seed=0)
    next(batches)   # the shard's hash check and first pages are paid once, before the clock
    started = time.perf_counter()
    for _ in range(steps):
      next(batches)
    seconds = time.perf_counter() - started
    rows.append({'packing': packing, 'batch_size': batch_size, 'seq_len': seq_len,
                 'batches_per_s': steps / seconds,
                 'tokens_per_s': steps * batch_size * seq_len / seconds})
  return rows


def _write_corpus(directory: str, megabytes: float) -> None:
  """Text files of the standard library, repeated under distinct names, to `megabytes` of tokens
  (two bytes each: half as many bytes of text)."""
  _, files = list_files('')
  os.makedirs(directory)
  written, copy = 0, 0
  while written < megabytes * 1e6 / 2:
    for path in files:
      target = os.path.join(directory, f'{copy:04d}-{os.path.basename(path)}')
      shutil.copyfile(path, target)
      written += os.path.getsize(target)
      if written >= megabytes * 1e6 / 2:
        break
    copy += 1


def _resident_mb() -> dict:
  """This process's resident memory now: private (anonymous) and file-backed (mapped page cache)."""
  with open('/proc/self/status') as f:
    fields = dict(line.split(':', 1) for line in f if line.startswith(('RssAnon', 'RssFile')))
  return {k: int(v.split()[0]) / 1024 for k, v in fields.items()}


def _reader_rss(prepared: str, batch_size: int, seq_len: int, steps: int) -> dict:
  """Run in a fresh process: its resident memory after opening the batches and reading `steps`."""
  before = _resident_mb()
  windows = Windows(PreparedData(prepared).split('train'), seq_len, True)
  batches = TokenBatches(windows, global_batch_size=batch_size, seed=0)
  for _ in range(steps):
    next(batches)
  after = _resident_mb()
  return {'private_mb_before': before['RssAnon'], 'private_mb_after': after['RssAnon'],
          'file_mb_after': after['RssFile'],
          'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
          'windows': windows.num_windows}


def bench_memory(scratch: str, sizes_mb: list[float], batch_size: int, seq_len: int) -> list[dict]:
  rows = []
  for size in sizes_mb:
    corpus, out = os.path.join(scratch, f'corpus-{size}'), os.path.join(scratch, f'prepared-{size}')
    _write_corpus(corpus, size)
    index = prepare(os.path.join(corpus, '*.py'), 'bytes', out, workers=2, progress=False)
    shutil.rmtree(corpus)
    code = ('import json, sys; from bench.data import _reader_rss; '
            f'print(json.dumps(_reader_rss({out!r}, {batch_size}, {seq_len}, 200)))')
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            check=True, env={**os.environ, 'PYTHONPATH': os.getcwd()})
    tokens = sum(s['tokens'] for s in index['splits'].values())
    rows.append({'token_mb': tokens * 2 / 1e6, 'shards': len(index['splits']['train']['shards']),
                 **json.loads(result.stdout.strip().splitlines()[-1])})
    shutil.rmtree(out)
  return rows


def _table(rows: list[dict]) -> str:
  keys = list(rows[0])
  fmt = lambda v: f'{v:.3g}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
  return '\n'.join(lines + ['| ' + ' | '.join(fmt(r[k]) for k in keys) + ' |' for r in rows])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='python -m bench.data', description=__doc__.split('\n')[0])
  parser.add_argument('what', choices=('prepare', 'loader', 'memory'))
  parser.add_argument('--tokenizer', default='bytes', choices=('bytes', 'bpe'))
  parser.add_argument('--workers', default='1,2')
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--seq_len', type=int, default=128)
  parser.add_argument('--steps', type=int, default=500)
  parser.add_argument('--sizes_mb', default='30,300,3000')
  parser.add_argument('--scratch', default=None)
  args = parser.parse_args(argv)
  scratch = tempfile.mkdtemp(dir=args.scratch)
  try:
    if args.what == 'prepare':
      rows = bench_prepare(scratch, args.tokenizer, [int(n) for n in args.workers.split(',')])
    elif args.what == 'loader':
      rows = bench_loader(scratch, args.batch_size, args.seq_len, args.steps)
    else:
      rows = bench_memory(scratch, [float(s) for s in args.sizes_mb.split(',')], args.batch_size,
                          args.seq_len)
  finally:
    shutil.rmtree(scratch, ignore_errors=True)
  print(_table(rows))


if __name__ == '__main__':
  main()
