"""Starting a run again: a finished run is left alone, more steps continue it, fewer are refused;
a resume logs each step once (metrics.jsonl and TensorBoard); a signal during the first
evaluation stops cleanly. Real `main.py` processes and checkpoints."""
import hashlib
import json
import os
import shutil
import signal
import subprocess

import pytest

from tests.helpers import child_environ
from tests.test_faults import main_args
from tests.test_run import ROOT, read_metrics, small_corpus
from train.metrics import event_files, event_records


def run(args) -> subprocess.CompletedProcess:
  return subprocess.run(args, cwd=ROOT, env=child_environ(), text=True,
                        capture_output=True, timeout=600)


def digests(folder) -> dict:
  """Every file under `folder` but the lock, by relative path: its sha256."""
  out = {}
  for root, _, names in os.walk(folder):
    for name in names:
      path = os.path.join(root, name)
      if name != '.lock':
        with open(path, 'rb') as f:
          out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
  return out


@pytest.fixture(scope='module')
def finished(tmp_path_factory):
  """A run of 6 steps, checkpoints at 4 and 6."""
  tmp = tmp_path_factory.mktemp('finished')
  corpus = small_corpus(tmp)
  workdir = tmp / 'run'
  result = run(main_args(workdir, corpus, '--config.train.steps=6',
                         '--config.train.checkpoint_every=4'))
  assert result.returncode == 0, result.stderr[-3000:]
  return workdir, corpus


def copy_of(finished, tmp_path):
  workdir, corpus = finished
  shutil.copytree(workdir, tmp_path / 'run')
  return tmp_path / 'run', corpus


def test_a_finished_run_started_again_changes_nothing_and_exits_0(finished, tmp_path):
  workdir, corpus = copy_of(finished, tmp_path)
  before = digests(workdir)
  result = run(main_args(workdir, corpus, '--config.train.steps=6'))
  assert result.returncode == 0, result.stderr[-3000:]
  lines = result.stdout.strip().splitlines()
  assert lines[0].startswith(f'run {workdir} is complete at step 6 (eval loss ')
  assert lines[0].endswith('; nothing to do')
  assert not any(line.startswith(('config ', 'memory ')) for line in lines)   # nothing compiled
  assert digests(workdir) == before


def test_fewer_steps_than_trained_are_refused_before_any_write(finished, tmp_path):
  workdir, corpus = copy_of(finished, tmp_path)
  before = digests(workdir)
  result = run(main_args(workdir, corpus, '--config.train.steps=5'))
  assert result.returncode != 0 and 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      f'error: the newest checkpoint in {workdir} is at step 6, past train.steps=5; give '
      f'train.steps=6 or more to continue that run, or use a fresh --workdir')
  assert digests(workdir) == before


def test_more_steps_continue_a_finished_run(finished, tmp_path):
  workdir, corpus = copy_of(finished, tmp_path)
  result = run(main_args(workdir, corpus, '--config.train.steps=8'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith('continuing  the run finished at step 6 to train.steps=8')
  rows = [row for row in read_metrics(workdir) if 'loss' in row]
  assert [row['step'] for row in rows] == list(range(1, 9))
  assert sorted(os.listdir(workdir / 'checkpoints')) == ['4', '6', '8']


def test_a_resume_logs_each_step_once_in_metrics_and_tensorboard(finished, tmp_path):
  """The newest checkpoint (6) removed: the run resumes from 4 and trains 5 and 6 again. Their old
  rows are replaced, not repeated, and the new ones have the same losses (CPU runs of one program
  are deterministic)."""
  workdir, corpus = copy_of(finished, tmp_path)
  first = {row['step']: row['loss'] for row in read_metrics(workdir) if 'loss' in row}
  shutil.rmtree(workdir / 'checkpoints' / '6')
  result = run(main_args(workdir, corpus, '--config.train.steps=6'))
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'resumed     from step 4' in result.stdout
  rows = read_metrics(workdir)
  assert [row['step'] for row in rows] == list(range(0, 7))
  assert {row['step']: row['loss'] for row in rows if 'loss' in row} == first
  evaluated = [row['step'] for row in rows if 'eval_loss' in row]
  assert evaluated[0] == 0 and evaluated[-1] == 6 and evaluated == sorted(set(evaluated))
  steps = [event.step for path in event_files(workdir / 'tensorboard')
           for _, event in event_records(path) for value in event.summary.value
           if value.tag == 'loss']
  assert sorted(steps) == list(range(1, 7))


def test_a_finished_run_without_its_final_evaluation_writes_it_into_that_steps_row(finished,
                                                                                 tmp_path):
  """The last row kept its loss but lost its evaluation: the run evaluates again and writes one
  row for step 6, with both."""
  workdir, corpus = copy_of(finished, tmp_path)
  rows = read_metrics(workdir)
  assert rows[-1]['step'] == 6 and 'eval_loss' in rows[-1]
  rows[-1] = {k: v for k, v in rows[-1].items() if not k.startswith('eval_')}
  (workdir / 'metrics.jsonl').write_text(''.join(json.dumps(row) + '\n' for row in rows))
  result = run(main_args(workdir, corpus, '--config.train.steps=6'))
  assert result.returncode == 0, result.stderr[-3000:]
  again = read_metrics(workdir)
  assert [row['step'] for row in again] == [row['step'] for row in rows]
  assert again[:-1] == rows[:-1]
  assert again[-1]['loss'] == rows[-1]['loss'] and 'eval_loss' in again[-1]


def test_sigterm_during_the_first_evaluation_stops_cleanly(tmp_path):
  """The signal arrives once the summary is printed (the state is being created or evaluated)."""
  corpus = small_corpus(tmp_path)
  workdir = tmp_path / 'run'
  proc = subprocess.Popen(main_args(workdir, corpus, '--config.train.steps=1000'), cwd=ROOT,
                          env=child_environ(PYTHONUNBUFFERED='1'), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
  for line in proc.stdout:
    if line.startswith('collectives'):   # the summary's last line: the step is compiled
      break
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == 0, err[-3000:]
  assert 'Traceback' not in err
  assert ('preempted   SIGTERM during the step-0 evaluation: nothing was trained and nothing '
          'saved; the same command starts the run again') in out
  assert not os.path.exists(workdir / 'checkpoints') or not os.listdir(workdir / 'checkpoints')
