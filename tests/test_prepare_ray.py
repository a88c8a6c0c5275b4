"""data.prepare on Ray (data/ray_engine.py): the same bytes as the local engine on a corpus of every
format, on a Ray started for the preparation (docs/data.md's command) and on a simulated cluster of
two nodes; a task whose worker is killed mid-group is run again, leaving no half-written file.
Skipped where Ray is not installed (it is a test requirement; tests/test_corpora.py checks the
one line without it)."""
import os
import re
import signal
import threading

import numpy as np
import pytest

ray = pytest.importorskip('ray', reason='Ray is not installed: pip install -r requirements-test.txt')

from data.prepare import prepare  # noqa: E402
from data.records import Reading, parse_delimiter  # noqa: E402
from tests.test_corpora import texts, write_jsonl  # noqa: E402
from tests.test_docs import run_documented  # noqa: E402


def _files(directory) -> dict:
  return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def _every_format(root):
  import pyarrow as pa
  import pyarrow.parquet as pq
  docs = texts(240, seed=1)
  root.mkdir()
  write_jsonl(root / 'a.jsonl', [{'text': t} for t in docs[:60]])
  write_jsonl(root / 'b.jsonl.gz', [{'text': t} for t in docs[60:120]], 'gz')
  write_jsonl(root / 'c.jsonl.zst', [{'text': t} for t in docs[120:160]], 'zst')
  pq.write_table(pa.table({'text': docs[160:200]}), root / 'd.parquet', row_group_size=7)
  (root / 'e.txt').write_text('<|endoftext|>'.join(docs[200:240]))
  return str(root / '*')


@pytest.fixture(scope='module')
def cluster():
  """A Ray cluster of two nodes of one CPU each, on this machine."""
  from ray.cluster_utils import Cluster
  nodes = Cluster(initialize_head=True, head_node_args={'num_cpus': 1, 'include_dashboard': False})
  nodes.add_node(num_cpus=1)
  nodes.wait_for_nodes()
  yield nodes
  nodes.shutdown()


def test_a_cluster_of_two_nodes_prepares_every_format_as_the_local_engine_does(cluster, tmp_path):
  pattern = _every_format(tmp_path / 'corpus')
  common = dict(val_fraction=0.2, shard_mb=0.01, progress=False,
                reading=Reading('text', parse_delimiter('<|endoftext|>')))
  local = prepare(pattern, 'bytes', str(tmp_path / 'local'), workers=2, **common)
  assert len(local['splits']['train']['shards']) > 3   # several groups, spread over the nodes
  prepare(pattern, 'bytes', str(tmp_path / 'ray'), engine='ray', ray_address=cluster.address,
          **common)
  assert _files(tmp_path / 'ray') == _files(tmp_path / 'local')
  assert not ray.is_initialized()   # the connection this opened is closed


def test_a_task_killed_mid_group_runs_again_and_leaves_no_half_written_file(cluster, tmp_path):
  """A worker is killed (SIGKILL) while it writes a group's shard: Ray runs the task again, the
  files are the local engine's, and no temporary file is left."""
  rng = np.random.default_rng(0)
  (tmp_path / 'big').mkdir()
  for i in range(4):   # 4 groups of 24 MB: long enough to be caught writing
    letters = rng.integers(ord('a'), ord('z') + 1, 24 << 20, dtype=np.uint8)
    (tmp_path / 'big' / f'{i}.txt').write_bytes(letters.tobytes())
  pattern, out = str(tmp_path / 'big' / '*.txt'), tmp_path / 'ray'
  out.mkdir()
  killed = []

  def kill_a_writer():
    while not killed and not stop.is_set():
      for name in os.listdir(out):
        # A shard being written by a worker (this process writes plan.json the same way).
        if (match := re.search(r'\.bin\.tmp(\d+)$', name)) and int(match[1]) != os.getpid():
          os.kill(int(match[1]), signal.SIGKILL)
          killed.append(name)
          return

  stop = threading.Event()
  watcher = threading.Thread(target=kill_a_writer)
  watcher.start()
  try:
    prepare(pattern, 'bytes', str(out), val_fraction=0.25, shard_mb=20, engine='ray',
            ray_address=cluster.address, progress=False)
  finally:
    stop.set()
    watcher.join()
  assert killed, 'no worker was caught writing'
  prepare(pattern, 'bytes', str(tmp_path / 'local'), val_fraction=0.25, shard_mb=20, progress=False)
  assert _files(out) == _files(tmp_path / 'local')   # (no .tmp file among them)


def test_the_documented_ray_command_writes_the_local_engines_bytes(tmp_path, monkeypatch):
  """docs/data.md's command: a Ray of 2 CPUs started for the preparation."""
  run_documented('docs/data.md', "python -m data.prepare --input='corpus/*' --text_field=text "
                 "--tokenizer=bytes --out=prepared-ray --engine=ray --workers=2 --shard_mb=0.05",
                 tmp_path)
  monkeypatch.chdir(tmp_path)   # the same relative glob, which the plan and index record
  prepare('corpus/*', 'bytes', 'local', shard_mb=0.05, progress=False)
  assert len(_files(tmp_path / 'local')) > 6 and _files(tmp_path / 'prepared-ray') == _files(
      tmp_path / 'local')
