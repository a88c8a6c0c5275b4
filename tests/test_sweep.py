"""Sweeps: the grid and its names, bad sweep files refused before anything runs, points run in
their own processes with a failure recorded and the rest going on, resume, Ctrl-C, and the
results (CSV, markdown, PNG) of a tiny training sweep end to end."""
import csv
import glob
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sweep import spec
from sweep.grid import Point, SweepError, axis, check_names, choices, product, zipped
from sweep.runner import Runner, last_error_line
from tests.helpers import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sweep_file(tmp_path, body: str, name: str = 'tiny_sweep.py') -> str:
  path = tmp_path / name
  path.write_text('from sweep.grid import axis, choices, product, zipped\n\n'
                  + textwrap.dedent(body))
  return str(path)


def _run(sweep_file: str, workdir, *flags, timeout=600) -> subprocess.CompletedProcess:
  return subprocess.run([*python(os.environ), '-m', 'sweep', f'--sweep={sweep_file}',
                         f'--workdir={workdir}', *flags], cwd=ROOT, capture_output=True, text=True,
                        timeout=timeout)


def _results(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'results.csv')) as f:
    return list(csv.DictReader(f))


def _record(workdir, name) -> dict:
  with open(os.path.join(workdir, 'runs', name, 'sweep.json')) as f:
    return json.load(f)


def test_the_grid_expands_and_names_its_points():
  points = product(choices('layout', {'ddp': {'mesh': {'data': -1}, 'parallel.zero_stage': 0},
                                      'zero3': {'mesh': {'fsdp': -1}, 'parallel.zero_stage': 3}}),
                   zipped(axis('host_devices', [8, 64], label='devices'),
                          axis('train.batch_size', [8, 64], label='')))
  assert [p.name for p in points] == ['layout=ddp_devices=8', 'layout=ddp_devices=64',
                                      'layout=zero3_devices=8', 'layout=zero3_devices=64']
  assert points[3].overrides == {'mesh.fsdp': -1, 'parallel.zero_stage': 3, 'host_devices': 64,
                                 'train.batch_size': 64}
  assert points[0].labels == {'layout': 'ddp', 'devices': 8}
  # Characters a directory name should not hold become '-'.
  assert Point({'targets': '.*/(a|b)'}, {}).name == 'targets=.---a-b-'
  check_names(points)


def test_grid_mistakes_are_refused():
  with pytest.raises(SweepError, match=r'zipped axes have different lengths \[2, 3\]'):
    zipped(axis('a', [1, 2]), axis('b', [1, 2, 3]))
  with pytest.raises(SweepError, match="override train.seed is 0 and 1 in one point"):
    product(axis('train.seed', [0], label='s'), axis('train.seed', [1], label='t'))
  with pytest.raises(SweepError, match="two points are both named 'seed=0'"):
    check_names(zipped(axis('train.seed', [0, 0]), axis('train.steps', [1, 2], label='')))
  with pytest.raises(SweepError, match="axis\\('train.seed'\\) has no values"):
    axis('train.seed', [])


@pytest.mark.parametrize('body, message', [
    ("def get_sweep():\n  return dict(title='t', command='train', config='configs/default.py',"
     " points=axis('train.seed', [0]), metrics=('final_loss',), colour='red')\n",
     "unknown sweep key 'colour'; allowed: title, command"),
    ("def get_sweep():\n  return dict(title='t', command='train', config='configs/default.py',"
     " points=[], metrics=('final_loss',))\n", 'the grid is empty'),
    ("def get_sweep():\n  return dict(title='t', command='fly', config='configs/default.py',"
     " points=axis('train.seed', [0]), metrics=())\n", "command='fly'; allowed: train, dry_run"),
    ("def get_sweep():\n  return dict(title='t', command='train', config='configs/default.py',"
     " points=axis('train.seed', [0]), metrics=('loss_of_nerve',))\n",
     "unknown metric 'loss_of_nerve'; known: final_loss"),
    ("def get_sweep():\n  return dict(title='t', command='train', config='configs/default.py',"
     " points=axis('train.seed', [0]), metrics=('final_loss',),"
     " charts=[dict(file='a.png', title='a', x='seed', y='tokens_per_sec')])\n",
     "chart a.png: y='tokens_per_sec' is not a label or metric of the sweep"),
    ("def get_sweep():\n  return dict(title='t', command='train', config='configs/default.py',"
     " points=axis('train.seed', [0]), metrics=('final_loss',),"
     " charts=[dict(file='a.png', title='a', x='seed', y='final_loss', where={'model': ['7b']})])\n",
     "chart a.png: where names 'model', not a label of the sweep; labels: seed"),
])
def test_bad_sweep_files_are_refused_in_one_line(tmp_path, body, message):
  with pytest.raises(SweepError, match=message):
    spec.load(_sweep_file(tmp_path, body))


@pytest.mark.parametrize('point, message', [
    ("axis('train.steeps', [10])", "point steeps=10: unknown config key 'train.steeps'; keys of "
                                   "train: b1, b2, batch_size"),
    ("axis('train.steps', ['ten'])", r"point steps=ten: train.steps='ten': "),
    ("axis('mesh.data', [3])", r"point data=3: mesh \{.*\} cannot fill 8 devices"),
    ("axis('precision', ['fp64'])", "point precision=fp64: .*fp64"),
    ("axis('bench_steps', [5])", "point bench_steps=5: bench_steps=5; .* for command bench only"),
    ("axis('bench_matmul_size', [256])", "point bench_matmul_size=256: .* for command bench only"),
])
def test_a_point_the_config_checks_refuse_stops_the_sweep_before_it_runs(tmp_path, point, message):
  path = _sweep_file(tmp_path, f"""
      def get_sweep():
        return dict(title='t', command='dry_run', config='configs/fsdp.py:tiny',
                    points={point}, metrics=('compiled_gb',))
      """)
  with pytest.raises(SweepError, match=message):
    spec.check(spec.load(path))


def test_the_command_line_refuses_before_writing_anything(tmp_path):
  path = _sweep_file(tmp_path, """
      def get_sweep():
        return dict(title='t', command='dry_run', config='configs/fsdp.py:tiny',
                    points=axis('mesh.data', [3]), metrics=('compiled_gb',))
      """)
  done = _run(path, tmp_path / 'w')
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1].startswith('error: point data=3: mesh')
  assert not (tmp_path / 'w').exists()


def test_the_last_error_line_is_the_one_that_says_why():
  log = 'step 1\nTraceback (most recent call last):\n  File "x"\nValueError: tensor=4 does not ' \
        'divide kv_heads=2\n'
  assert last_error_line(log) == 'ValueError: tensor=4 does not divide kv_heads=2'
  assert last_error_line('compiling\nerror: train.steps=0; it must be positive\nbye\n') == \
      'error: train.steps=0; it must be positive'
  assert last_error_line('') == 'no output'


def test_a_logged_command_appends_to_its_log_and_says_why_it_failed(tmp_path):
  """Runner.run_logged, what the sweep's points and bench.gpu's claim run through: each attempt
  appended after a line naming it, the failure's line returned, nothing started once stopping."""
  log, runner = str(tmp_path / 'log.txt'), Runner(parallel=1)
  fail = [sys.executable, '-c', 'import os; print(os.environ["X"]); raise ValueError("no good")']
  assert runner.run_logged(fail, log, env=dict(os.environ, X='from env')) == (
      1, 'ValueError: no good')
  assert runner.run_logged([sys.executable, '-c', 'print("fine")'], log) == (0, '')
  text = open(log).read()
  assert text.count('\n=== ') == 2 and 'from env' in text and text.rstrip().endswith('fine')
  assert "-c 'import os;" in text   # the command as a shell would take it
  runner.stop()
  assert runner.run_logged([sys.executable, '-c', 'print("late")'], log)[0] == -1
  assert open(log).read().splitlines()[-1].startswith('=== ')   # named, never run


DRY_RUN_SWEEP = """
    def get_sweep():
      return dict(title='Tiny dry runs', command='dry_run', config='configs/fsdp.py:tiny',
                  overrides={'host_devices': 2, 'train.batch_size': 2},
                  points=choices('layout', {'ddp': {'mesh.data': -1, 'mesh.fsdp': 1,
                                                    'parallel.zero_stage': 0},
                                            'zero3': {'mesh.data': 1, 'mesh.fsdp': -1,
                                                      'parallel.zero_stage': 3},
                                            # kv_heads=2: a tensor axis of 4 fails at run time
                                            'tp4': {'host_devices': 4, 'train.batch_size': 4,
                                                    'mesh.data': 1, 'mesh.fsdp': 1,
                                                    'mesh.tensor': 4}}),
                  metrics=('compiled_gb', 'collective_gb', 'modelled_tflops', 'wall_s'))
    """


def test_a_failing_point_is_recorded_and_the_others_run_and_resume_skips_them(tmp_path):
  path, workdir = _sweep_file(tmp_path, DRY_RUN_SWEEP), tmp_path / 'w'
  done = _run(path, workdir)
  assert done.returncode == 1, done.stderr[-2000:]   # exit status: some point failed
  rows = {r['layout']: r for r in _results(workdir)}
  assert rows['ddp']['status'] == rows['zero3']['status'] == 'done'
  assert rows['tp4']['status'] == 'failed'
  assert 'kv_heads' in rows['tp4']['error'] or 'tensor' in rows['tp4']['error']
  for layout in ('ddp', 'zero3'):
    assert float(rows[layout]['compiled_gb']) > 0
    # The cost model's TFLOP/s per GPU cannot pass the H100's bf16 peak at its assumed MFU.
    assert 0 < float(rows[layout]['modelled_tflops']) < 989 * 0.45
  assert float(rows['zero3']['collective_gb']) > 0 and float(rows['ddp']['collective_gb']) > 0
  markdown = (workdir / 'results.md').read_text()
  assert '| layout=ddp' not in markdown and '| ddp | done |' in markdown
  assert 'layout=tp4`: failed: ' in markdown
  first = {n: _record(workdir, f'layout={n}') for n in ('ddp', 'zero3', 'tp4')}

  # Again: the finished points are skipped, the failed one runs again.
  done = _run(path, workdir)
  assert '2 finished, 1 to run' in done.stdout
  again = {n: _record(workdir, f'layout={n}') for n in ('ddp', 'zero3', 'tp4')}
  assert again['ddp'] == first['ddp'] and again['zero3'] == first['zero3']
  assert again['tp4']['status'] == 'failed'
  log = (workdir / 'runs' / 'layout=tp4' / 'log.txt').read_text()
  assert log.count('\n=== ') == 2   # both attempts kept in its log

  # A point whose settings changed is refused before anything runs; so is a foreign directory.
  changed = path.replace('tiny_sweep.py', 'changed.py')
  with open(changed, 'w') as f:
    f.write(open(path).read().replace("'train.batch_size': 2}", "'train.batch_size': 4}"))
  done = _run(changed, workdir)
  assert done.returncode != 0 and 'was run with other settings' in done.stderr
  assert _record(workdir, 'layout=ddp') == first['ddp']
  os.makedirs(tmp_path / 'w2' / 'runs' / 'layout=ddp')
  done = _run(path, tmp_path / 'w2', '--only=ddp')
  assert done.returncode != 0 and 'is not a point of a sweep' in done.stderr


TRAIN_SWEEP = """
    def get_sweep():
      return dict(title='Tiny training', command='train', config='configs/default.py:tiny',
                  overrides={'train.steps': 6, 'train.log_every': 2, 'train.eval_every': 6},
                  points=axis('precision', ['fp32', 'bf16_mixed']),
                  metrics=('final_loss', 'final_loss_sem', 'tokens_per_sec', 'mfu',
                           'state_bytes_per_param', 'wall_s'),
                  charts=[dict(file='loss.png', kind='scatter', x='state_bytes_per_param',
                               y='final_loss', yerr='final_loss_sem', series='precision',
                               title='Tiny: loss vs bytes per parameter')])
    """


def test_a_tiny_training_sweep_end_to_end(tmp_path):
  path, workdir = _sweep_file(tmp_path, TRAIN_SWEEP), tmp_path / 'w'
  done = _run(path, workdir, '--parallel=2')
  assert done.returncode == 0, done.stderr[-3000:]
  rows = _results(workdir)
  assert [r['precision'] for r in rows] == ['fp32', 'bf16_mixed']
  for r in rows:
    assert r['status'] == 'done'
    assert 0 < float(r['final_loss']) < 6 and float(r['final_loss_sem']) > 0
    assert float(r['tokens_per_sec']) > 0 and float(r['wall_s']) > 0
    assert r['mfu'] == ''   # a CPU has no datasheet peak: left empty, not invented
    assert float(r['state_bytes_per_param']) == pytest.approx(16)   # fp32 or fp32 master + Adam
  # Each point's final evaluation is the last row its run logged.
  with open(workdir / 'runs' / 'precision=fp32' / 'metrics.jsonl') as f:
    last = [json.loads(line) for line in f][-1]
  assert float(rows[0]['final_loss']) == last['eval_loss']
  assert rows[0]['overrides'] == ('config=configs/default.py:tiny train.steps=6 train.log_every=2 '
                                  'train.eval_every=6 precision=fp32')
  # The data was prepared once for the sweep, and every point read that copy.
  prepared = [d for d in os.listdir(workdir / 'data')]
  assert len(prepared) == 1
  for name in ('precision=fp32', 'precision=bf16_mixed'):
    with open(workdir / 'runs' / name / 'config.json') as f:
      assert json.load(f)['data']['path'] == str(workdir / 'data' / prepared[0])
    assert not (workdir / 'runs' / name / 'data').exists()
  markdown = (workdir / 'results.md').read_text()
  assert '| precision | status | validation loss (nats/token) |' in markdown
  assert '![loss.png](loss.png)' in markdown
  assert (workdir / 'loss.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert os.listdir(workdir / 'tensorboard')


def test_ctrl_c_stops_the_points_and_writes_no_results(tmp_path):
  path = _sweep_file(tmp_path, """
      def get_sweep():
        return dict(title='Long', command='train', config='configs/default.py:tiny',
                    overrides={'train.steps': 100000, 'train.log_every': 1},
                    points=axis('train.seed', [0]), metrics=('final_loss',))
      """)
  workdir = tmp_path / 'w'
  process = subprocess.Popen([*python(os.environ), '-m', 'sweep', f'--sweep={path}',
                              f'--workdir={workdir}'], cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
  log = workdir / 'runs' / 'seed=0' / 'metrics.jsonl'
  deadline = time.time() + 300
  while not (log.exists() and log.read_text().count('\n') >= 3) and time.time() < deadline:
    time.sleep(0.5)
  assert log.exists(), 'the point never started training'
  process.send_signal(signal.SIGINT)
  _, stderr = process.communicate(timeout=300)
  assert process.returncode != 0 and 'interrupted' in stderr
  assert _record(workdir, 'seed=0')['status'] == 'interrupted'
  assert not (workdir / 'results.csv').exists() and not (workdir / 'results.md').exists()
  # The run saved a checkpoint on the way out: the same command resumes it.
  assert os.listdir(workdir / 'runs' / 'seed=0' / 'checkpoints')


def test_a_before_run_is_its_own_config_and_the_points_name_its_workdir(tmp_path):
  from sweep.runner import Job
  path = _sweep_file(tmp_path, """
      def get_sweep():
        return dict(title='t', command='train', config='configs/lora.py:tiny',
                    before={'base': {'config': 'configs/default.py:tiny', 'train.steps': 8}},
                    overrides={'init_from': 'run:{base}', 'train.steps': 4},
                    points=axis('lora.rank', [2, 4]), metrics=('final_loss',))
      """)
  sweep = spec.load(path)
  spec.check(sweep)
  base = Job(sweep, sweep.before['base'], str(tmp_path / 'w'), {})
  point = Job(sweep, sweep.points[1], str(tmp_path / 'w'), {})
  assert base.workdir == str(tmp_path / 'w' / 'before' / 'base')
  assert '--config.train.steps=8' in base.argv and not any('init_from' in a for a in base.argv)
  assert f'--config.init_from=run:{tmp_path / "w" / "before" / "base"}' in point.argv
  assert '--config.lora.rank=4' in point.argv and '--config.train.steps=4' in point.argv
  assert point.workdir == str(tmp_path / 'w' / 'runs' / 'rank=4')


def test_a_torn_line_leaves_the_rest_of_a_points_rows(tmp_path):
  """A run killed mid-write leaves half a line in metrics.jsonl: the point still counts as
  finished and reports its evaluation (the torn line alone is left out)."""
  from sweep.metrics import METRICS, PointFiles
  from sweep.runner import Job
  sweep = spec.load(_sweep_file(tmp_path, TRAIN_SWEEP))
  job = Job(sweep, sweep.points[0], str(tmp_path / 'w'), {})
  os.makedirs(job.workdir)
  rows = [{'step': 2, 'loss': 5.0}, {'step': 6, 'loss': 4.0}, {'step': 6, 'eval_loss': 4.25}]
  with open(os.path.join(job.workdir, 'metrics.jsonl'), 'w') as f:
    f.write(''.join(json.dumps(r) + '\n' for r in rows) + '{"step": 8, "lo')
  assert job.complete()
  files = PointFiles(job.workdir, sweep.target, spec.config_of(sweep, sweep.points[0]))
  assert files.rows() == rows
  assert METRICS['final_loss'].read(files) == 4.25


@pytest.mark.parametrize('command, point, metrics', [
    # The MFU of a bench point against a 256^2 matmul's rate (bench_matmul_size): bench.train_step's
    # own 2048^2, measured twice for bf16 compute, would be half of the point's CPU here.
    ('bench', "product(axis('precision', ['bf16_mixed']), axis('bench_matmul_size', [256]))",
     ('tokens_per_sec', 'mfu', 'compiled_gb')),
    ('plan', "axis('target', ['1xRTX4090-24GB'])", ('plan_step_s', 'plan_compiled_gb')),
])
def test_bench_and_plan_points_report_their_figures(tmp_path, command, point, metrics):
  path = _sweep_file(tmp_path, f"""
      def get_sweep():
        return dict(title='t', command='{command}', config='configs/default.py:tiny',
                    points={point}, metrics={metrics + ('plan_recipe',)!r})
      """)
  done = _run(path, tmp_path / 'w')
  assert done.returncode == 0, done.stderr[-2000:]
  [row] = _results(tmp_path / 'w')
  for metric in metrics:
    assert float(row[metric]) > 0, (metric, row)
  assert (row['plan_recipe'] != '') == (command == 'plan')
  if command == 'bench':   # the key reached bench.train_step as its flag
    [bench] = glob.glob(str(tmp_path / 'w' / 'runs' / '*' / 'bench.json'))
    assert json.load(open(bench))['matmul_size'] == 256


def test_a_sweep_file_that_raises_is_reported_in_one_line(tmp_path):
  path = _sweep_file(tmp_path, "def get_sweep():\n  return dict(points=zipped(axis('a', [1]), "
                                "axis('b', [1, 2])))\n")
  with pytest.raises(SweepError, match=r'zipped axes have different lengths \[1, 2\]'):
    spec.load(path)
  path = _sweep_file(tmp_path, "def get_sweep():\n  return dict(title=undefined_name)\n", 'b.py')
  with pytest.raises(SweepError, match=r"b.py: NameError: name 'undefined_name' is not defined"):
    spec.load(path)


def test_a_chart_draws_only_the_points_its_where_names():
  from sweep.charts import _groups
  rows = [{'model': m, 'devices': d, 'error': e}
          for m, d, e in (('1b', 8, 1.0), ('1b', 64, 2.0), ('1b-lora', 8, 9.0))]
  groups = _groups(rows, dict(x='devices', y='error', where={'model': ['1b']}))
  # The case shares the grid's x but not its model: left out, not averaged in.
  assert groups == {None: {None: [(8, 1.0, None, 1), (64, 2.0, None, 1)]}}
