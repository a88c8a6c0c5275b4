"""The data pipeline's costs: preparation throughput, loader throughput, per-process memory against
corpus size.

  python -m bench.data prepare [--tokenizer=bytes|bpe] [--workers=1,2]   # MB of input per second
  python -m bench.data loader [--batch_size=16 --seq_len=128]             # tokens per second read
  python -m bench.data memory [--sizes_mb=30,300,3000]                    # peak RSS per corpus size
  python -m bench.data formats [--input_mb=1000] [--workers=1,2]          # MB/s and peak RSS per format
  python -m bench.data tokenizer [--input_mb=100 --vocab_size=32000]      # BPE training time
  python -m bench.data curves --runs=W1,W2 [--chart=PNG]                  # loss in bits per byte
  python -m bench.data start [--input_mb=10000]                           # a run's start on it
  python -m bench.data engines [--input_mb=10000]                         # local against Ray

`prepare` runs `data.prepare` on the embedded corpus (31.5 MB of the standard library's source) cut
into groups of 4 MiB, with the byte tokenizer or a 4096-token byte-level BPE trained here on a slice
of the same corpus (`--tokenizer=bpe`), once per worker count. `loader` reads batches from
the prepared corpus through `TokenBatches`, as a training process does, packed and unpacked.
`memory` writes corpora of the given sizes in token bytes (text repeated from the standard
library under distinct names, prepared with the byte tokenizer), then in a fresh process per size
opens the training batches and reads 200 of them, and reports the process's resident memory:
private (anonymous) before and after, file-backed (the mapped shards' pages) after, and the peak.
`formats` writes the same documents (standard-library files, repeated under distinct ids to
--input_mb of text) as JSON Lines, gzip- and zstd-compressed JSON Lines and Parquet, 16 files each,
and prepares each format with the byte tokenizer, once per worker count, in a fresh process: input
MB/s (of the documents' text) and documents/s, and the peak resident memory of the preparing
processes together (sampled every 50 ms) and of the largest one. `tokenizer` trains a byte-level BPE
of --vocab_size tokens (python -m data.tokenizer) on --input_mb of that JSON Lines, in a fresh
process: seconds and peak resident memory.
`curves` reads finished runs' metrics.jsonl (e.g. one with the byte tokenizer, one with a BPE, on
the same data) and puts their losses on one scale, bits per byte of input text: the training loss
every log step through the train split's bytes per token, the validation loss as evaluated; with
--chart, a PNG of both against steps and against input bytes seen.
`start` prepares --input_mb of that repeated text (byte tokenizer) and times a run's start on it in
a fresh process per `data.verify_inputs` mode, with the bytes it read to check inputs and shards.
`engines` prepares --input_mb of it with the local engine and on Ray (`--engine=ray`, a Ray started
for it), --workers each, in a fresh process each: MB/s of text and peak resident memory of the
process tree, and checks that both wrote the same shards.
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

import numpy as np

from data import PreparedData, TokenBatches, Windows
from data.corpus import list_files
from data.files import VERIFY_MODES
from data.records import FORMATS
from data.prepare import prepare
from train.metrics import read_rows


def _bpe_tokenizer(directory: str) -> str:
  """A 4096-token byte-level BPE trained on 4 MB of the corpus (data/train_tokenizer.py)."""
  from data.train_tokenizer import train
  out = os.path.join(directory, 'tokenizer')
  train('', 4096, out, max_mb=4, progress=False)
  return out


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
  (the byte tokenizer's: a byte each, as many as the text's bytes)."""
  _, files = list_files('')
  os.makedirs(directory)
  written, copy = 0, 0
  while written < megabytes * 1e6:
    for path in files:
      target = os.path.join(directory, f'{copy:04d}-{os.path.basename(path)}')
      shutil.copyfile(path, target)
      written += os.path.getsize(target)
      if written >= megabytes * 1e6:
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


def _write_formats(directory: str, megabytes: float, files: int = 16) -> int:
  """The same documents in every record format, `files` files each; returns the documents."""
  import gzip
  import pyarrow as pa
  import pyarrow.parquet as pq
  import zstandard
  _, paths = list_files('')
  documents, size = [], 0
  while size < megabytes * 1e6:
    for path in paths:
      with open(path, encoding='utf-8', errors='replace') as f:
        text = f.read()
      documents.append({'id': f'{len(documents)}', 'text': text})
      size += len(text.encode('utf-8'))
      if size >= megabytes * 1e6:
        break
  for fmt in FORMATS[1:]:
    os.makedirs(os.path.join(directory, fmt))
  for i in range(files):
    part = documents[i::files]
    name = os.path.join(directory, '{}', f'part-{i:02d}.{{}}')
    lines = ''.join(json.dumps(d) + '\n' for d in part).encode()
    with open(name.format('jsonl', 'jsonl'), 'wb') as f:
      f.write(lines)
    with gzip.open(name.format('jsonl.gz', 'jsonl.gz'), 'wb', compresslevel=6) as f:
      f.write(lines)
    with open(name.format('jsonl.zst', 'jsonl.zst'), 'wb') as f:
      f.write(zstandard.ZstdCompressor(level=3).compress(lines))
    pq.write_table(pa.Table.from_pylist(part), name.format('parquet', 'parquet'),
                   row_group_size=1024)
  return len(documents)


def _tree_rss_mb(root: int) -> tuple[float, float]:
  """(resident MB of `root` and its descendants together, of the largest one), from /proc."""
  parents, rss = {}, {}
  for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
      with open(f'/proc/{pid}/status') as f:
        fields = dict(line.split(':', 1) for line in f)
    except OSError:
      continue
    parents[int(pid)] = int(fields['PPid'])
    rss[int(pid)] = int(fields.get('VmRSS', '0 kB').split()[0]) / 1024
  tree = {root}
  for _ in range(4):   # workers are children of the preparing process: two levels suffice
    tree |= {pid for pid, parent in parents.items() if parent in tree}
  sizes = [rss.get(pid, 0.0) for pid in tree]
  return sum(sizes), max(sizes)


def _measured(argv: list[str]) -> dict:
  """Runs `argv`; its seconds and the peak resident memory of its processes (sampled)."""
  started = time.perf_counter()
  child = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
  total = largest = 0.0
  while child.poll() is None:
    together, one = _tree_rss_mb(child.pid)
    total, largest = max(total, together), max(largest, one)
    time.sleep(0.05)
  seconds = time.perf_counter() - started
  output = child.stdout.read()
  if child.returncode:
    raise RuntimeError(f'{" ".join(argv)} failed:\n{output}')
  return {'seconds': seconds, 'peak_rss_mb': total, 'largest_process_mb': largest,
          'output': output}


def bench_formats(scratch: str, megabytes: float, workers: list[int]) -> list[dict]:
  documents = _write_formats(scratch, megabytes)
  rows = []
  for fmt in FORMATS[1:]:
    for n in workers:
      out = os.path.join(scratch, f'prepared-{fmt}-{n}')
      run = _measured([sys.executable, '-m', 'data.prepare', f'--input={scratch}/{fmt}/*',
                       f'--out={out}', f'--workers={n}', '--shard_mb=64'])
      index = PreparedData(out).index
      size = sum(s['bytes'] for s in index['splits'].values())
      stored = sum(os.path.getsize(os.path.join(scratch, fmt, f))
                   for f in os.listdir(os.path.join(scratch, fmt)))
      assert sum(s['documents'] for s in index['splits'].values()) == documents
      rows.append({'format': fmt, 'workers': n, 'file_mb': stored / 1e6, 'text_mb': size / 1e6,
                   'seconds': run['seconds'], 'text_mb_per_s': size / 1e6 / run['seconds'],
                   'documents_per_s': documents / run['seconds'],
                   'peak_rss_mb': run['peak_rss_mb'],
                   'largest_process_mb': run['largest_process_mb']})
      shutil.rmtree(out)
  return rows


def start_once(prepared: str, verify: str) -> None:
  """One run's start on `prepared` (a fresh process): its data opened and checked as
  data.verify_inputs=`verify` says, and a first batch taken (which opens this process's shards);
  prints the seconds and the bytes read to check, as JSON."""
  from data import files
  from data.source import SourceKey, open_data
  started = time.perf_counter()
  data = open_data(SourceKey(prepared, 'bytes', 0.05), os.path.dirname(prepared), progress=False,
                   verify=verify)
  next(TokenBatches(Windows(data.split('train'), 2048, True), global_batch_size=8, seed=0))
  print(json.dumps({'seconds': time.perf_counter() - started, 'read': files.verified['bytes']}))


def bench_start(scratch: str, megabytes: float, workers: int) -> list[dict]:
  """A corpus of `megabytes` of text prepared (byte tokenizer), then a run's start on it in a
  fresh process per data.verify_inputs mode (the files are in the page cache from the
  preparation: the time of the reads, not of a cold disk)."""
  corpus, prepared = os.path.join(scratch, 'corpus'), os.path.join(scratch, 'prepared')
  _write_corpus(corpus, megabytes)
  made = _measured([sys.executable, '-m', 'data.prepare', f'--input={corpus}/*',
                    '--tokenizer=bytes', f'--out={prepared}', f'--workers={workers}'])
  text = sum(s['bytes'] for s in PreparedData(prepared).index['splits'].values())
  shards = sum(os.path.getsize(os.path.join(prepared, f)) for f in os.listdir(prepared)
               if f.endswith('.bin'))
  rows = []
  for verify in VERIFY_MODES:
    run = _measured([sys.executable, '-c', f'from bench.data import start_once; '
                     f'start_once({prepared!r}, {verify!r})'])
    start = json.loads(run['output'].strip().splitlines()[-1])
    rows.append({'text_mb': text / 1e6, 'shards_mb': shards / 1e6, 'files': len(os.listdir(corpus)),
                 'prepare_s': made['seconds'], 'verify_inputs': verify,
                 'start_s': start['seconds'], 'read_mb': start['read'] / 1e6,
                 'process_s': run['seconds']})
  return rows


def bench_engines(scratch: str, megabytes: float, workers: int) -> list[dict]:
  """`megabytes` of text prepared (byte tokenizer) by the local engine and on a Ray started for it,
  `workers` each, in a fresh process each: MB/s of text and peak resident memory; the two
  directories' indexes (every shard's sha256 among them) must be equal."""
  corpus = os.path.join(scratch, 'corpus')
  _write_corpus(corpus, megabytes)
  rows, indexes = [], {}
  for engine in ('local', 'ray'):
    out = os.path.join(scratch, f'prepared-{engine}')
    run = _measured([sys.executable, '-m', 'data.prepare', f'--input={corpus}/*', '--tokenizer=bytes',
                     f'--out={out}', f'--workers={workers}', f'--engine={engine}'])
    index = PreparedData(out).index
    indexes[engine] = {k: v for k, v in index.items() if k != 'inputs'}
    text = sum(s['bytes'] for s in index['splits'].values())
    rows.append({'engine': engine, 'workers': workers, 'text_mb': text / 1e6,
                 'groups': len(index['splits']['train']['shards']), 'seconds': run['seconds'],
                 'text_mb_per_s': text / 1e6 / run['seconds'], 'peak_rss_mb': run['peak_rss_mb'],
                 'largest_process_mb': run['largest_process_mb']})
  if indexes['local'] != indexes['ray']:
    raise RuntimeError('the Ray engine wrote other shards than the local one')
  for row in rows:
    row['vs_local'] = row['text_mb_per_s'] / rows[0]['text_mb_per_s']
  return rows


def bench_tokenizer(scratch: str, megabytes: float, vocab_size: int) -> list[dict]:
  _write_formats(scratch, megabytes, files=4)
  for fmt in FORMATS[2:]:
    shutil.rmtree(os.path.join(scratch, fmt))
  run = _measured([sys.executable, '-m', 'data.tokenizer', f'--input={scratch}/jsonl/*',
                   f'--vocab_size={vocab_size}', f'--out={scratch}/tokenizer'])
  return [{'input_mb': megabytes, 'vocab_size': vocab_size, 'seconds': run['seconds'],
           'peak_rss_mb': run['peak_rss_mb'], 'printed': run['output'].strip().splitlines()[-1]}]


def _run_curve(workdir: str) -> dict:
  """A finished run's losses in bits per byte (see `curves`)."""
  import glob
  import math
  with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
    config = json.load(f)
  path = config['data']['path']
  index = os.path.join(path, 'index.json') if os.path.isdir(path) else \
      glob.glob(os.path.join(workdir, 'data', '*', 'index.json'))[0]
  prepared = PreparedData(os.path.dirname(index))
  per_token = prepared.bytes_per_token('train')
  rows = read_rows(os.path.join(workdir, 'metrics.jsonl'))
  tokens_per_step = config['train']['batch_size'] * config['train']['seq_len']
  return {'run': workdir, 'tokenizer': config['data']['tokenizer'],
          'vocab_size': config['model']['vocab_size'], 'train_bytes_per_token': per_token,
          'train': [(r['step'], r['loss'] / math.log(2) / per_token) for r in rows if 'loss' in r],
          'eval': [(r['step'], r['eval_bits_per_byte'], r['eval_bits_per_byte_sem'])
                   for r in rows if 'eval_bits_per_byte' in r],
          'bytes_per_step': tokens_per_step * per_token,
          'tokens_per_s': float(np.median([r['tokens_per_sec'] for r in rows
                                           if 'tokens_per_sec' in r]))}


def bench_curves(workdirs: list[str], chart: str | None) -> list[dict]:
  curves = [_run_curve(w) for w in workdirs]
  rows = []
  for c in curves:
    for step, bits, sem in c['eval']:
      train = [b for s, b in c['train'] if s == step]
      rows.append({'run': os.path.basename(c['run']), 'vocab': c['vocab_size'], 'step': step,
                   'input_mb_seen': step * c['bytes_per_step'] / 1e6,
                   'train_bits_per_byte': train[0] if train else float('nan'),
                   'eval_bits_per_byte': bits, 'eval_sem': sem,
                   'text_kb_per_s': c['tokens_per_s'] * c['train_bytes_per_token'] / 1e3})
  if chart:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for c in curves:
      label = f'{os.path.basename(c["run"])} (vocabulary {c["vocab_size"]:,})'
      steps, bits = zip(*c['train'])
      axes[0].plot(steps, bits, label=label)
      axes[1].plot([s * c['bytes_per_step'] / 1e6 for s in steps], bits, label=label)
      for ax, scale in ((axes[0], 1), (axes[1], c['bytes_per_step'] / 1e6)):
        ax.errorbar([s * scale for s, _, _ in c['eval']], [b for _, b, _ in c['eval']],
                    yerr=[e for _, _, e in c['eval']], fmt='o', color=ax.lines[-1].get_color())
    axes[0].set_xlabel('step')
    axes[1].set_xlabel('input text seen (MB)')
    axes[0].set_ylabel('loss (bits per byte; dots: validation)')
    axes[0].set_ylim(top=4)
    axes[0].legend()
    figure.tight_layout()
    figure.savefig(chart, dpi=100)
  return rows


def _table(rows: list[dict]) -> str:
  keys = list(rows[0])
  fmt = lambda v: f'{v:.3g}' if isinstance(v, float) else str(v)
  lines = ['| ' + ' | '.join(keys) + ' |', '|' + '---|' * len(keys)]
  return '\n'.join(lines + ['| ' + ' | '.join(fmt(r[k]) for k in keys) + ' |' for r in rows])


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='python -m bench.data', description=__doc__.split('\n')[0])
  parser.add_argument('what', choices=('prepare', 'loader', 'memory', 'formats', 'tokenizer',
                                       'curves', 'start', 'engines'))
  parser.add_argument('--tokenizer', default='bytes', choices=('bytes', 'bpe'))
  parser.add_argument('--workers', default='1,2')
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--seq_len', type=int, default=128)
  parser.add_argument('--steps', type=int, default=500)
  parser.add_argument('--sizes_mb', default='30,300,3000')
  parser.add_argument('--input_mb', type=float, default=None,
                      help='formats: MB of text per format (default 1000); tokenizer: (100); '
                      'start, engines: (10000)')
  parser.add_argument('--vocab_size', type=int, default=32000)
  parser.add_argument('--runs', default='', help='curves: finished runs\' workdirs, comma-separated')
  parser.add_argument('--chart', default=None, help='curves: a PNG to write')
  parser.add_argument('--scratch', default=None)
  args = parser.parse_args(argv)
  scratch = tempfile.mkdtemp(dir=args.scratch)
  try:
    if args.what == 'prepare':
      rows = bench_prepare(scratch, args.tokenizer, [int(n) for n in args.workers.split(',')])
    elif args.what == 'formats':
      rows = bench_formats(scratch, args.input_mb or 1000, [int(n) for n in args.workers.split(',')])
    elif args.what == 'curves':
      rows = bench_curves(args.runs.split(','), args.chart)
    elif args.what == 'engines':
      rows = bench_engines(scratch, args.input_mb or 10000, max(int(n) for n in args.workers.split(',')))
    elif args.what == 'start':
      rows = bench_start(scratch, args.input_mb or 10000, max(int(n) for n in args.workers.split(',')))
    elif args.what == 'tokenizer':
      rows = bench_tokenizer(scratch, args.input_mb or 100, args.vocab_size)
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
