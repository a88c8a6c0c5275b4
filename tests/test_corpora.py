"""Real corpora (data/records.py, data/prepare.py, data/train_tokenizer.py, data/mixture.py): JSON
Lines plain and compressed, Parquet and delimited text prepared into the documents they hold; bad
records refused in one line or skipped and counted; a BPE tokenizer trained and used by a run;
mixtures drawn in their proportions, resumed exactly, scored per source."""
import gzip
import json
import os
import shutil
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from data import DataError, PreparedData
from data.mixture import PERIOD, MixtureBatches, parse, shares
from data.prepare import main as prepare_main, prepare
from data.records import Reading, parse_delimiter
from data.tokenizer import HFTokenizer
from data.corpus import held_out
from data.records import BadRecords, documents, file_format
from data.train_tokenizer import corpus_texts, train as train_tokenizer
from data.windows import Windows
from tests.helpers import tiny_config
from tests.test_run import losses_by_step, read_metrics
from train import run


def texts(count: int, seed: int) -> list[str]:
  """Documents of a few hundred bytes, some with non-ASCII text."""
  rng = np.random.default_rng(seed)
  words = ['def', 'return', 'the', 'data', 'é', 'ünï', '日本', 'x', '=', '(', ')', '\n']
  return [' '.join(rng.choice(words, size=int(rng.integers(20, 120)))) for _ in range(count)]


def write_jsonl(path, records: list, compress: str = '') -> None:
  data = ''.join(json.dumps(r) + '\n' for r in records).encode()
  if compress == 'gz':
    data = gzip.compress(data)
  elif compress == 'zst':
    data = zstandard.ZstdCompressor().compress(data)
  path.write_bytes(data)


@pytest.fixture(scope='module')
def corpus(tmp_path_factory):
  """One directory of every format, 240 documents in all; returns (directory, every text)."""
  root = tmp_path_factory.mktemp('corpus')
  docs = texts(240, seed=0)
  write_jsonl(root / 'a.jsonl', [{'text': t, 'id': i} for i, t in enumerate(docs[:60])])
  write_jsonl(root / 'b.jsonl.gz', [{'text': t} for t in docs[60:120]], 'gz')
  write_jsonl(root / 'c.jsonl.zst', [{'text': t} for t in docs[120:160]], 'zst')
  pq.write_table(pa.table({'text': docs[160:200], 'n': list(range(40))}), root / 'd.parquet',
                 row_group_size=7)
  (root / 'e.txt').write_text('<|endoftext|>'.join(docs[200:240]) + '<|endoftext|>')
  return root, docs


def stored_documents(out) -> list[bytes]:
  """Every document a byte-tokenized preparation holds (markers removed), train then val."""
  prepared = PreparedData(str(out))
  found = []
  for split in ('train', 'val'):
    shards = prepared.split(split)
    for shard in range(len(shards)):
      tokens = np.asarray(shards.shard_tokens(shard))
      bounds = list(shards.document_starts(shard)) + [len(tokens)]
      found += [bytes(tokens[a + 1:b - 1].astype(np.uint8)) for a, b in zip(bounds, bounds[1:])]
  return found


def test_every_format_prepares_into_the_documents_it_holds(corpus, tmp_path):
  root, docs = corpus
  out = tmp_path / 'out'
  assert prepare_main([f'--input={root}/*', '--text_field=text', '--tokenizer=bytes',
                       f'--out={out}', '--document_delimiter=<|endoftext|>',
                       '--val_fraction=0.2']) == 0
  assert sorted(stored_documents(out)) == sorted(t.encode() for t in docs)
  index = json.loads((out / 'index.json').read_text())
  assert index['splits']['val']['documents'] > 0 and 'bad_records' not in index
  # Input bytes are the documents' UTF-8 bytes (bits per byte compares across formats).
  assert index['splits']['train']['bytes'] + index['splits']['val']['bytes'] == \
      sum(len(t.encode()) for t in docs)

  # A JSON Lines file cut into pieces for several workers holds the same documents on the same
  # sides (each document's side is a hash of its file and its place in it, not of the piece).
  (tmp_path / 'one').mkdir()
  shutil.copy(root / 'a.jsonl', tmp_path / 'one' / 'a.jsonl')
  whole, cut = tmp_path / 'whole', tmp_path / 'cut'
  prepare(str(tmp_path / 'one' / '*'), 'bytes', str(whole), val_fraction=0.2, progress=False)
  plan_mb = os.path.getsize(root / 'a.jsonl') / 5 / 2**20
  prepare(str(tmp_path / 'one' / '*'), 'bytes', str(cut), val_fraction=0.2, shard_mb=plan_mb,
          workers=2, progress=False)
  assert len(json.loads((cut / 'plan.json').read_text())['groups']) == 5
  for split in ('train', 'val'):
    assert (sorted(_split_docs(whole, split)) == sorted(_split_docs(cut, split)))


def test_a_large_parquet_file_is_cut_by_row_groups_into_groups_with_the_same_sides(corpus,
                                                                                  tmp_path):
  """A Parquet file larger than a group is cut into ranges of its row groups, one group each,
  for workers to share; every document lands on the side it lands on whole (its key is its row)."""
  _, docs = corpus
  (tmp_path / 'one').mkdir()
  pq.write_table(pa.table({'text': docs, 'n': list(range(len(docs)))}),
                 tmp_path / 'one' / 'big.parquet', row_group_size=10)   # 24 row groups
  pattern = str(tmp_path / 'one' / '*')
  whole, cut = tmp_path / 'whole', tmp_path / 'cut'
  prepare(pattern, 'bytes', str(whole), val_fraction=0.2, progress=False)
  plan_mb = os.path.getsize(tmp_path / 'one' / 'big.parquet') / 6.5 / 2**20   # 6 pieces
  prepare(pattern, 'bytes', str(cut), val_fraction=0.2, shard_mb=plan_mb, workers=2,
          progress=False)
  assert len(json.loads((whole / 'plan.json').read_text())['groups']) == 1
  assert len(json.loads((cut / 'plan.json').read_text())['groups']) == 6
  for split in ('train', 'val'):
    assert sorted(_split_docs(whole, split)) == sorted(_split_docs(cut, split))
  assert sorted(_split_docs(cut, 'train') + _split_docs(cut, 'val')) == sorted(
      t.encode() for t in docs)
  # No more pieces than row groups, however small the groups asked for.
  finest = tmp_path / 'finest'
  prepare(pattern, 'bytes', str(finest), val_fraction=0.2, shard_mb=1e-6, progress=False)
  assert len(json.loads((finest / 'plan.json').read_text())['groups']) == 24
  assert sorted(_split_docs(finest, 'val')) == sorted(_split_docs(whole, 'val'))


def _split_docs(out, split):
  shards = PreparedData(str(out)).split(split)
  docs = []
  for shard in range(len(shards)):
    tokens = bytes(np.asarray(shards.shard_tokens(shard)).astype(np.uint8))
    docs += tokens.split(b'\x00')
  return [d for d in docs if d]


def test_a_dotted_field_reaches_into_objects(tmp_path):
  write_jsonl(tmp_path / 'a.jsonl', [{'meta': {'body': 'first'}}, {'meta': {'body': 'second'}}])
  pq.write_table(pa.table({'meta': [{'body': 'third'}, {'body': 'fourth'}]}),
                 tmp_path / 'b.parquet')
  out = tmp_path / 'out'
  prepare(str(tmp_path / '*'), 'bytes', str(out), reading=Reading('meta.body'), val_fraction=0.5,
          progress=False)
  assert sorted(stored_documents(out)) == [b'first', b'fourth', b'second', b'third']
  with pytest.raises(DataError, match=r"b.parquet has no column 'body'.*columns: meta"):
    prepare(str(tmp_path / '*'), 'bytes', str(tmp_path / 'x'), reading=Reading('body'),
            progress=False)
  assert not (tmp_path / 'x').exists()
  assert parse_delimiter(r'\n\n') == '\n\n' and parse_delimiter('<|endoftext|>') == '<|endoftext|>'


BAD = [{'text': 'good one'}, 'not json {', {'title': 'no text'}, {'text': 7},
       {'text': 'nul \x00 inside'}, {'text': 'good two'}]


def _write_bad(path):
  lines = [r if isinstance(r, str) else json.dumps(r) for r in BAD]
  path.write_bytes(('\n'.join(lines) + '\n').encode() + b'{"text": "\xff\xfe"}\n')


def test_a_bad_record_stops_preparation_naming_file_line_and_reason(tmp_path):
  (tmp_path / 'in').mkdir()
  _write_bad(tmp_path / 'in' / 'bad.jsonl')
  write_jsonl(tmp_path / 'in' / 'good.jsonl.gz', [{'text': t} for t in texts(30, 1)], 'gz')
  out = tmp_path / 'out'
  with pytest.raises(DataError) as info:
    prepare(str(tmp_path / 'in' / '*'), 'bytes', str(out), workers=2, shard_mb=1e-4,
            progress=False)
  message = str(info.value)
  assert '\n' not in message and 'bad.jsonl line 2: invalid JSON' in message
  # Nothing half-written is left as if complete: no index, no record of the bad group, no
  # temporary file; the good group may be finished (kept for the resume).
  names = os.listdir(out)
  assert 'index.json' not in names and not any('.tmp' in n for n in names)
  assert not any(n.startswith('group-') and json.loads((out / n).read_text())['inputs'].get(
      'bad.jsonl') for n in names)
  with pytest.raises(SystemExit):   # the same refusal from the command line, as one line
    prepare_main([f'--input={tmp_path}/in/*', f'--out={out}', '--on_bad_record=maybe'])

  # The same command with skip finishes it; every reason counted, with its first place.
  prepare(str(tmp_path / 'in' / '*'), 'bytes', str(out), workers=2, shard_mb=1e-4,
          on_bad_record='skip', progress=False)
  bad = json.loads((out / 'index.json').read_text())['bad_records']
  where = {reason.split(' (')[0]: entry['first'] for reason, entry in bad.items()}
  assert all(entry['count'] == 1 for entry in bad.values())
  assert where == {'invalid JSON': [f'{tmp_path}/in/bad.jsonl line 2'],
                   "no field 'text'": [f'{tmp_path}/in/bad.jsonl line 3'],
                   "field 'text' is a int, not a string": [f'{tmp_path}/in/bad.jsonl line 4'],
                   'a NUL byte, which the byte tokenizer keeps for document boundaries':
                       [f'{tmp_path}/in/bad.jsonl line 5'],
                   'bytes that are not UTF-8': [f'{tmp_path}/in/bad.jsonl line 7']}
  assert {b'good one', b'good two'} <= set(stored_documents(out))


def test_a_pool_worker_killed_mid_group_stops_preparation_in_one_line_and_a_rerun_finishes(
    tmp_path):
  """A worker of the local engine's pool is killed (SIGKILL, as the out-of-memory killer does)
  while it writes a group's shard: `python -m data.prepare` stops with one line and exit code 2
  (it used to wait forever for the lost group), leaves no half-written file, and the same command
  again finishes with the bytes of an uninterrupted preparation."""
  import re
  import signal
  import subprocess
  import threading
  import time
  from tests.helpers import child_environ
  rng = np.random.default_rng(0)
  (tmp_path / 'big').mkdir()
  for i in range(4):   # 4 groups of 24 MB: long enough to be caught writing
    letters = rng.integers(ord('a'), ord('z') + 1, 24 << 20, dtype=np.uint8)
    (tmp_path / 'big' / f'{i}.txt').write_bytes(letters.tobytes())
  out, root = tmp_path / 'killed', os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out.mkdir()
  command = [sys.executable, '-m', 'data.prepare', f'--input={tmp_path}/big/*.txt',
             f'--out={out}', '--val_fraction=0.25', '--shard_mb=20', '--workers=2']
  killed, stop = [], threading.Event()

  def kill_a_writer():
    while not killed and not stop.is_set():
      for name in os.listdir(out):   # a shard being written by a worker, named by its pid
        if match := re.search(r'\.bin\.tmp(\d+)$', name):
          os.kill(int(match[1]), signal.SIGKILL)
          killed.append(name)
          return
      time.sleep(0.001)   # a look a millisecond: the two workers keep the cores

  watcher = threading.Thread(target=kill_a_writer)
  watcher.start()
  try:
    done = subprocess.run(command, cwd=root, env=child_environ(), capture_output=True, text=True,
                          timeout=300)
  finally:
    stop.set()
    watcher.join()
  assert killed and done.returncode == 2, done.stderr[-2000:]
  assert done.stderr.strip().splitlines()[-1].startswith(
      'error: a preparing worker process died (exit code -9: killed by the system, out of '
      'memory?); run the same command again')
  assert not any('.tmp' in name for name in os.listdir(out))
  subprocess.run(command, cwd=root, env=child_environ(), check=True, capture_output=True,
                 timeout=300)
  prepare(f'{tmp_path}/big/*.txt', 'bytes', str(tmp_path / 'whole'), val_fraction=0.25,
          shard_mb=20, progress=False)
  files = lambda d: {p.name: p.read_bytes() for p in sorted(d.iterdir())}
  assert files(out) == files(tmp_path / 'whole')


def test_a_cut_compressed_file_is_a_bad_record(tmp_path):
  data = gzip.compress(''.join(json.dumps({'text': t}) + '\n' for t in texts(50, 2)).encode())
  (tmp_path / 'cut.jsonl.gz').write_bytes(data[:len(data) // 2])
  with pytest.raises(DataError, match='cut.jsonl.gz after line .*: the compressed stream is cut'):
    prepare(str(tmp_path / '*.gz'), 'bytes', str(tmp_path / 'a'), progress=False)
  index = prepare(str(tmp_path / '*.gz'), 'bytes', str(tmp_path / 'b'), on_bad_record='skip',
                  val_fraction=0.5, progress=False)
  [reason] = index['bad_records']
  assert reason.startswith('the compressed stream is cut short')
  assert 0 < index['splits']['train']['documents'] + index['splits']['val']['documents'] < 50


@pytest.mark.parametrize('kind', ['records', 'whole files', 'cut files'])
def test_the_tokenizer_trains_on_the_training_side_data_prepare_makes(corpus, tmp_path, kind):
  """The documents `python -m data.tokenizer` reads at a --val_fraction are those data.prepare
  puts in train at that fraction, none of its validation documents: records of every format, whole
  text files sent to a side by their path, and text files each cut into a training and a
  validation part (where the paths alone would leave a side empty)."""
  root, docs = corpus
  delimiter = ''
  if kind == 'records':
    pattern, delimiter = f'{root}/*', '<|endoftext|>'
  else:
    names = [f'f{i}.txt' for i in range(12)] if kind == 'whole files' else ['only.txt']
    for i, name in enumerate(names):
      (tmp_path / name).write_text(''.join(docs[20 * i:20 * i + 20]))
    pattern = f'{tmp_path}/*.txt'
  out = tmp_path / 'out'
  prepare(pattern, 'bytes', str(out), val_fraction=0.3, progress=False,
          reading=Reading('text', parse_delimiter(delimiter)))
  train_side, val_side = _split_docs(out, 'train'), _split_docs(out, 'val')
  assert train_side and val_side
  read = [text.encode() for text, _ in corpus_texts(
      pattern, Reading('text', parse_delimiter(delimiter)), BadRecords('fail'), val_fraction=0.3)]
  # (A file cut by bytes may be cut inside a character, which the tokenizer reads as U+FFFD.)
  assert sorted(read) == sorted(d.decode('utf-8', errors='replace').encode() for d in train_side)
  everything = [text for text, _ in corpus_texts(
      pattern, Reading('text', parse_delimiter(delimiter)), BadRecords('fail'), val_fraction=0)]
  assert len(b''.join(t.encode() for t in everything)) == sum(map(len, train_side + val_side))


def test_a_trained_tokenizer_round_trips_and_a_run_takes_its_vocabulary(corpus, tmp_path):
  root, docs = corpus
  tokenizer_dir = tmp_path / 'tok'
  summary = train_tokenizer(f'{root}/*.jsonl*', 300, str(tokenizer_dir), progress=False)
  # (Up to 300: merging stops where no pair of this small vocabulary occurs twice.)
  assert 258 < summary['vocab_size'] <= 300
  with pytest.raises(DataError, match=r"^--val_fraction=0.7 must be in \(0, 0.5\]"):
    train_tokenizer(f'{root}/*.jsonl*', 300, str(tmp_path / 'wide'), val_fraction=0.7,
                    progress=False)
  assert not (tmp_path / 'wide').exists()
  # The 160 documents less those data.prepare holds out at its default --val_fraction, 0.05
  # (which ones: the test above).
  held = sum(held_out(f'{os.path.basename(p)}:{d.key}', 0.05)
             for p in sorted(map(str, root.glob('*.jsonl*')))
             for d in documents(p, file_format(p), Reading(), BadRecords('fail')))
  assert 0 < held < 160 and summary['documents'] == 160 - held and summary['val_fraction'] == 0.05
  tokenizer = HFTokenizer(str(tokenizer_dir))
  assert (tokenizer.vocab_size, tokenizer.bos_id, tokenizer.eos_id) == (summary['vocab_size'], 0, 1)
  for text in docs[:5]:   # byte-level BPE: any text encodes and decodes exactly, in fewer tokens
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text and len(ids) < len(text.encode())
  with pytest.raises(DataError, match='is not empty'):
    train_tokenizer(f'{root}/*.jsonl*', 300, str(tokenizer_dir), progress=False)
  with pytest.raises(DataError, match='at least 258'):
    train_tokenizer(f'{root}/*.jsonl*', 100, str(tmp_path / 'small'), progress=False)

  # A run on a glob of JSON Lines (prepared into its cache with the tokenizer): the model's
  # vocabulary is the tokenizer's, padded to 384.
  workdir = tmp_path / 'run'
  run.train_and_evaluate(tiny_config(**{
      'train.steps': 2, 'data.path': f'{root}/*.jsonl*', 'data.tokenizer': str(tokenizer_dir),
      'data.val_fraction': 0.2}), str(workdir))
  assert json.loads((workdir / 'config.json').read_text())['model']['vocab_size'] == 384
  [row] = [r for r in read_metrics(workdir) if r.get('step') == 2 and 'eval_loss' in r]
  assert row['eval_loss'] < np.log(384)


def test_a_mixture_is_parsed_or_refused_in_one_line():
  parts = parse('code=0.7:/a,prose=0.3:/b/*.jsonl')
  assert [(p.name, round(p.weight, 6), p.path) for p in parts] == [
      ('code', 0.7, '/a'), ('prose', 0.3, '/b/*.jsonl')]
  assert parse('/data/*.jsonl') is None and parse('') is None
  for bad, why in (('code=0.7:/a,/b', 'is not NAME=WEIGHT:PATH'),
                   ('a=1:/a,a=2:/b', 'names a source twice'),
                   ('a=0:/a,b=1:/b', 'positive number')):
    with pytest.raises(DataError, match=why):
      parse(bad)
  assert shares([0.7, 0.3]).tolist() == [2867, 1229] and shares([1 / 3] * 3).sum() == PERIOD


def test_bad_data_settings_are_refused_before_anything_is_written(tmp_path):
  for key, value, why in (('data.on_bad_record', 'maybe', 'allowed: fail, skip'),
                          ('data.text_field', 'meta.', 'dotted path'),
                          ('data.path', f'a=1:{tmp_path}/none/*.jsonl', 'matches no files')):
    with pytest.raises(DataError, match=why) as info:
      run.dry_run(tiny_config(**{key: value}), str(tmp_path / 'w'))
    assert '\n' not in str(info.value) and not (tmp_path / 'w').exists()


def test_a_mixture_draws_its_proportions_from_the_step_alone(corpus, tmp_path):
  root, _ = corpus
  sources = []
  for name, pattern in (('a', 'a.jsonl'), ('b', 'b.jsonl.gz')):
    out = tmp_path / name
    prepare(str(root / pattern), 'bytes', str(out), val_fraction=0.2, progress=False)
    sources.append((name, 0.75 if name == 'a' else 0.25,
                    Windows(PreparedData(str(out)).split('train'), 32, True)))
  whole = MixtureBatches(sources, global_batch_size=8, seed=3)
  draws = [whole.draws(step) for step in range(PERIOD)]
  rows = [source for step in draws[:PERIOD // 8] for source, _ in step]
  assert rows.count(0) == 3072 and rows.count(1) == 1024   # exact over a period's PERIOD rows
  for row in range(8):   # each row draws its exact share over a period, numbered 0, 1, 2, ...
    dealt = [step[row] for step in draws]
    for source, share in ((0, 3072), (1, 1024)):
      assert [n for s, n in dealt if s == source] == list(range(share))
  source, drawn = whole.draws(PERIOD)[2]   # the next period numbers on from this one's
  assert drawn == (3072, 1024)[source]
  # Two processes feed the rows of the same global batches, at the start and across a period's
  # end; a state resumes the same stream.
  halves = [MixtureBatches(sources, global_batch_size=8, seed=3, process_index=p,
                           process_count=2) for p in (0, 1)]
  for start in (0, PERIOD - 2):
    for batches in (whole, *halves):
      batches.set_state({**batches.get_state(), 'step': start})
    for _ in range(3):
      expected, parts = next(whole), [next(h) for h in halves]
      for k, v in expected.items():
        assert np.array_equal(np.concatenate([part[k] for part in parts]), v)
  resumed = MixtureBatches(sources, global_batch_size=8, seed=3)
  resumed.set_state(json.loads(json.dumps(whole.get_state())))
  again, expected = next(resumed), next(whole)
  assert all(np.array_equal(again[k], v) for k, v in expected.items())
  with pytest.raises(DataError, match='same mixture'):
    MixtureBatches(sources, global_batch_size=8, seed=4).set_state(whole.get_state())


def test_a_mixture_process_reads_only_its_rows_lanes_of_each_source(corpus, tmp_path):
  """As a single source's: process p of 2 opens only the shards of its half of each source's
  windows (the halves meet in at most one shard), before the first batch and after many."""
  root, _ = corpus
  for name in ('a', 'd'):
    prepare(str(root / f'{name}.*'), 'bytes', str(tmp_path / name), val_fraction=0.2,
            shard_mb=1e-3, progress=False)
  def process(index, count=2, batch=8):
    sources = [(name, 0.5, Windows(PreparedData(str(tmp_path / name)).split('train'), 16, True))
               for name in ('a', 'd')]
    return MixtureBatches(sources, global_batch_size=batch, seed=1, process_index=index,
                          process_count=count), [w.shards for _, _, w in sources]
  halves = [process(p) for p in (0, 1)]
  at_start = [[set(shards.opened) for shards in opened] for _, opened in halves]
  for batches, _ in halves:
    for _ in range(256):   # more than an epoch of every lane
      next(batches)
  for (_, opened), start in zip(halves, at_start):
    assert [set(shards.opened) for shards in opened] == start
  for source, shards in enumerate(halves[0][1]):
    assert len(shards) >= 4
    first, second = at_start[0][source], at_start[1][source]
    assert len(first | second) == len(shards) and len(first & second) <= 1
  # A source with fewer windows than rows is refused by name; so is an earlier version's state.
  with pytest.raises(DataError, match="source 'a': the train split has .* train.batch_size=4096"):
    process(0, count=1, batch=4096)
  old = {k: v for k, v in halves[0][0].get_state().items() if k != 'deal'}
  with pytest.raises(DataError, match=r"^the checkpoint's data position \(step 256\) was saved "
                                      r"by an earlier version's mixture.*init_from=run:"):
    process(0)[0].set_state(old)


def test_a_mixture_trains_resumes_exactly_and_is_scored_per_source(corpus, tmp_path):
  root, _ = corpus
  code = tmp_path / 'code'
  prepare(str(root / 'a.jsonl'), 'bytes', str(code), val_fraction=0.2, progress=False)
  # One prepared directory, one glob that the run prepares into its cache.
  mixture = f'code=0.7:{code},prose=0.3:{root}/*.parquet'
  config = tiny_config(**{'train.steps': 4, 'train.checkpoint_every': 2, 'train.log_every': 1,
                          'train.eval_every': 4, 'data.path': mixture, 'data.val_fraction': 0.2})
  straight = tmp_path / 'straight'
  run.train_and_evaluate(config, str(straight))
  resumed = tmp_path / 'resumed'
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / 'checkpoints' / '4')
  run.train_and_evaluate(config, str(resumed))
  assert losses_by_step(resumed) == losses_by_step(straight)
  [last] = [r for r in read_metrics(straight) if r.get('step') == 4 and 'eval_loss' in r]
  assert np.isclose(last['eval_loss'], 0.7 * last['eval_loss/code'] + 0.3 * last['eval_loss/prose'])


def test_without_ray_the_engine_is_refused_in_one_line_writing_nothing(tmp_path, monkeypatch):
  monkeypatch.setitem(sys.modules, 'ray', None)   # `import ray` raises ImportError
  (tmp_path / 'a.txt').write_text('text')
  with pytest.raises(DataError, match=r'^--engine=ray needs Ray, which is not installed: pip '
                                      r'install "ray>=2.9" \(or use --engine=local\)$'):
    prepare(str(tmp_path / 'a.txt'), 'bytes', str(tmp_path / 'out'), engine='ray')
  assert not (tmp_path / 'out').exists()
