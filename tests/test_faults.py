"""Faults a run survives: kill -9, SIGTERM / SIGINT, non-finite steps, broken checkpoints, a second
writer, and a resume on another mesh. Kills and signals hit real `main.py` processes."""
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

from configs.layouts import layout_config
from optim.adam8bit import is_quantized_moment
from quant.blockwise import dequantize_blockwise
from tests.helpers import child_environ, python, tiny_config
from tests.test_run import ROOT, losses_by_step, read_metrics, small_corpus
from train import run
from train.checkpoint import Checkpointer, CheckpointError
from train.loop import NonFiniteError
from train.metrics import truncate_jsonl
from train.workdir_lock import WorkdirBusy, workdir_lock


def main_args(workdir, corpus, *overrides, fresh: bool = False):
  """`fresh`: in a new interpreter, for a test whose SIGKILL must land on the run itself."""
  return [*([sys.executable] if fresh else python()), os.path.join(ROOT, 'main.py'),
          '--config=configs/default.py:tiny',
          f'--workdir={workdir}', f'--config.data.path={corpus}', '--config.train.log_every=1',
          '--config.sample.length=8', *overrides]


def start(args) -> subprocess.Popen:
  return subprocess.Popen(args, cwd=ROOT, env=child_environ(), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_step(workdir, proc, step: int, timeout: float = 300) -> int:
  """Block until metrics.jsonl logs a training step >= `step`; returns the newest logged step."""
  deadline = time.monotonic() + timeout
  path = os.path.join(workdir, 'metrics.jsonl')
  while time.monotonic() < deadline:
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    if os.path.exists(path):
      with open(path) as f:
        steps = [row['step'] for row in map(json.loads, f.read().splitlines()[:-1] or []) if 'loss' in row]
      if steps and steps[-1] >= step:
        return steps[-1]
    time.sleep(0.05)
  raise TimeoutError(f'{workdir} did not reach step {step}')


def every_logged_loss(workdir) -> dict[int, set]:
  """Each step's losses over every attempt that logged it (a resumed run logs some steps twice)."""
  seen: dict[int, set] = {}
  for row in read_metrics(workdir):
    if 'loss' in row:
      seen.setdefault(row['step'], set()).add(row['loss'])
  return seen


def test_kill_9_sigterm_and_sigint_at_any_point_then_resume_equals_the_uninterrupted_run(tmp_path):
  """One workdir through SIGTERM, kill -9 inside a checkpoint write, kill -9 at a random point and
  SIGTERM again; each restart resumes and every step it logs has the uninterrupted run's loss
  (CPU runs of one program are deterministic: exactly equal). The reference run ends by SIGINT."""
  corpus = small_corpus(tmp_path)
  # Never reached: every run here ends by a signal. A checkpoint every 4 steps, so that kills land
  # during or right after writes.
  overrides = ['--config.train.steps=100000', '--config.train.checkpoint_every=4']

  def stop(workdir, at_step, signum):
    """Run until step >= at_step, send `signum`; returns the step the run saved at."""
    proc = start(main_args(workdir, corpus, *overrides))
    wait_for_step(workdir, proc, at_step)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    line = next(line for line in out.splitlines() if line.startswith('preempted'))
    step = int(line.split(' at step ')[1].split(':')[0])
    assert f'preempted   {signal.Signals(signum).name} at step {step}: saved a checkpoint' in line
    assert (workdir / 'checkpoints' / str(step)).is_dir()
    return step

  def kill(workdir, during_write: bool, rng):
    proc = start(main_args(workdir, corpus, *overrides, fresh=True))
    wait_for_step(workdir, proc, 1 + max(losses_by_step(workdir)))
    if during_write:   # orbax writes into a temporary folder, renamed when complete
      while not any('tmp' in name for name in os.listdir(workdir / 'checkpoints')):
        assert proc.poll() is None
        time.sleep(0.001)
    else:
      time.sleep(rng.uniform(0, 0.5))
    proc.send_signal(signal.SIGKILL)
    proc.communicate()

  straight = tmp_path / 'straight'
  end = stop(straight, 40, signal.SIGINT)   # well past the kills below, a few steps after step 10
  faulty = tmp_path / 'faulty'
  first = stop(faulty, 10, signal.SIGTERM)
  rng = random.Random(0)
  kill(faulty, True, rng)
  kill(faulty, False, rng)
  stop(faulty, end, signal.SIGTERM)
  reference = losses_by_step(straight)
  logged = every_logged_loss(faulty)
  assert first < end and min(logged) == 1
  assert all(logged[step] == {reference[step]} for step in range(1, end + 1))


def test_non_finite_steps_are_skipped_then_the_run_stops_leaving_finite_checkpoints(tmp_path):
  config = tiny_config(**{'train.steps': 200, 'train.checkpoint_every': 4, 'train.log_every': 1,
                          'train.learning_rate': 1e3, 'train.grad_clip': 1e9,
                          'train.max_bad_steps': 3, 'data.path': small_corpus(tmp_path)})
  workdir = tmp_path / 'w'
  with pytest.raises(NonFiniteError, match=r'step (\d+): the loss or gradients were not finite '
                     r'for 3 steps in a row \(train.max_bad_steps=3\)') as error:
    run.train_and_evaluate(config, str(workdir))
  stopped_at = int(str(error.value).split()[1].rstrip(':'))
  rows = {row['step']: row for row in read_metrics(workdir) if 'loss' in row}
  assert max(rows) == stopped_at
  assert all(rows[s]['nonfinite'] and rows[s]['skipped'] for s in range(stopped_at - 2, stopped_at + 1))
  assert not rows[stopped_at - 3]['nonfinite'] and rows[stopped_at]['skipped_steps'] >= 3
  checkpoints = Checkpointer(str(workdir / 'checkpoints'), keep=3)
  assert checkpoints.steps() and max(checkpoints.steps()) <= stopped_at
  assert f'the newest checkpoint, step {max(checkpoints.steps())}, is where a rerun resumes' in str(error.value)
  s = run.setup(config)
  for step in checkpoints.steps():
    state, _ = checkpoints.restore(step, s.layout.abstract)
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state))
  checkpoints.close()


@pytest.fixture(scope='module')
def six_step_run(tmp_path_factory):
  """A finished 6-step run with checkpoints at 2, 4 and 6, made once; tests corrupt copies."""
  tmp = tmp_path_factory.mktemp('six')
  config = tiny_config(**{'train.steps': 6, 'train.checkpoint_every': 2, 'train.log_every': 1,
                          'data.path': small_corpus(tmp)})
  run.train_and_evaluate(config, str(tmp / 'straight'))
  return config, tmp / 'straight'


def _copy(run_dir, tmp_path):
  copy = tmp_path / 'w'
  shutil.copytree(run_dir, copy)
  return copy


def _files(folder) -> dict:
  return {str(p.relative_to(folder)): p.read_bytes() for p in folder.rglob('*')
          if p.is_file() and p.name != '.lock'}


CORRUPTIONS = {
    'garbage metadata': lambda d: (d / 'state' / '_METADATA').write_text('{not json'),
    'truncated arrays': lambda d: [p.write_bytes(p.read_bytes()[:10])
                                   for p in (d / 'state').rglob('*') if p.is_file()],
    'missing array files': lambda d: [shutil.rmtree(p) for p in (d / 'state').glob('ocdbt.process_*')],
    'garbage everywhere': lambda d: [p.write_bytes(os.urandom(300)) for p in d.rglob('*') if p.is_file()],
    # One bit of the arrays' data file: the format's own decoding passes it (orbax reads back
    # other values without an error); only the saved digests catch it.
    'a flipped bit that still decodes': lambda d: _flip_a_bit(
        max((d / 'state').glob('ocdbt.process_*/d/*'), key=lambda p: p.stat().st_size)),
}


def _flip_a_bit(path) -> None:
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0x10
  path.write_bytes(bytes(data))


@pytest.mark.parametrize('corruption', sorted(CORRUPTIONS))
def test_a_broken_newest_checkpoint_is_reported_and_the_run_resumes_from_the_one_before(
    tmp_path, corruption, capsys, six_step_run):
  config, straight = six_step_run
  workdir = _copy(straight, tmp_path)
  CORRUPTIONS[corruption](workdir / 'checkpoints' / '6')
  broken = _files(workdir / 'checkpoints' / '6')
  # Rows cut back to step 4: with the final evaluation recorded the run is complete, and a rerun
  # has nothing to do (train/resume.py).
  truncate_jsonl(str(workdir / 'metrics.jsonl'), keep_before=5)
  run.train_and_evaluate(config, str(workdir))
  out = capsys.readouterr().out
  assert f'checkpoint  {workdir}/checkpoints/6 does not restore (' in out
  if corruption == 'a flipped bit that still decodes':
    assert 'does not restore (DigestMismatch: ' in out
  assert 'resumed     from step 4' in out
  assert losses_by_step(workdir) == losses_by_step(straight)
  assert [row['step'] for row in read_metrics(workdir) if 'loss' in row] == list(range(1, 7))
  # Nothing deleted: the broken checkpoint was moved aside as it was.
  assert _files(workdir / 'checkpoints-broken' / '6') == broken


RESTORE_WITHOUT_FILE_DESCRIPTORS = """
import os, resource, sys
from tests.helpers import tiny_config
from train import run
from train.checkpoint import Checkpointer, RestoreFailed
s = run.setup(tiny_config())
checkpoints = Checkpointer(sys.argv[1], keep=3)
limit = max(map(int, os.listdir('/proc/self/fd'))) + 8
resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
held = []
while True:   # every descriptor below the limit taken: no file opens from here on
  try:
    held.append(os.open(os.devnull, os.O_RDONLY))
  except OSError:
    break
try:
  checkpoints.restore_newest(s.layout.abstract, unpadded=s.layout.unpadded)
except RestoreFailed as e:
  print(e)
"""


def test_an_io_error_during_a_restore_changes_nothing_and_says_run_again(tmp_path, six_step_run):
  """A real I/O failure (no file descriptor left: EMFILE) is no evidence against the checkpoint:
  the newest one is neither set aside nor passed over, and the error says to retry."""
  _, straight = six_step_run
  workdir = _copy(straight, tmp_path)
  before = _files(workdir)
  result = subprocess.run([sys.executable, '-c', RESTORE_WITHOUT_FILE_DESCRIPTORS,
                           str(workdir / 'checkpoints')], cwd=ROOT, capture_output=True, text=True,
                          env=child_environ('--xla_force_host_platform_device_count=8'),
                          timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert result.stdout.startswith(f'{workdir}/checkpoints/6 could not be read ('), result.stdout
  # Which read fails first (orbax's metadata, a data file) depends on the machine; each is named.
  assert 'OSError: [Errno ' in result.stdout or 'RESOURCE_EXHAUSTED' in result.stdout
  assert result.stdout.strip().endswith('nothing was changed: run the same command again to retry')
  assert 'trying an older one' not in result.stdout
  assert _files(workdir) == before and not (workdir / 'checkpoints-broken').exists()


@pytest.mark.parametrize('error, broken, temporary', [
    (FileNotFoundError(2, 'No such file or directory'), True, False),
    (ValueError('DATA_LOSS: Error reading "params.w/0.0"'), True, False),
    (ValueError('FAILED_PRECONDITION: Truncated Zstd-compressed data'), True, False),
    (ValueError('Found incomplete checkpoint at /w/checkpoints/6.'), True, False),
    (ValueError('UNAVAILABLE: Error reading "params.w/0.0": Input/output error'), False, True),
    (ValueError('RESOURCE_EXHAUSTED: Out of memory'), False, True),
    (OSError(5, 'Input/output error'), False, True),
    (MemoryError(), False, True),
    (TypeError("restore() got an unexpected keyword argument 'strict'"), False, False),
])
def test_only_evidence_against_a_checkpoint_counts_as_broken(error, broken, temporary):
  """Evidence passes over a checkpoint; a failure that a retry may pass exits 75; anything else
  stops with exit 1. What an error was raised *while handling* is no evidence: only its causes."""
  from train.checkpoint import is_broken, is_temporary
  wrapped = Exception('Encountered error while reading array index')   # as orbax wraps them
  wrapped.__cause__ = error
  for e in (error, wrapped):
    assert is_broken(e) is broken and (is_temporary(e) is temporary or broken)
  during = OSError(5, 'Input/output error')   # raised while a cache miss was handled
  during.__context__ = KeyError('params')
  assert not is_broken(during) and is_temporary(during)


def test_a_lost_peers_line_is_printed_during_a_restore(tmp_path):
  """While a checkpoint is tried only orbax's own noise is held back: the watch's line for a lost
  peer (written from its thread as the process leaves) reaches stderr."""
  code = ('from parallel.peers import _exit_lost\n'
          'from train.checkpoint import _quiet\n'
          'with _quiet():\n'
          f'  _exit_lost(0, "process 1", "no heartbeat for 10 s", {str(tmp_path)!r})\n')
  result = subprocess.run([sys.executable, '-c', code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
  assert result.returncode == 75
  assert result.stderr.strip().startswith('error: lost process 1 (no heartbeat for 10 s); process 0')


def test_a_host_arrays_digest_is_the_devices_in_any_number_of_pieces():
  from train.digest import host_digest, tree_digests
  x = np.random.default_rng(0).standard_normal((37, 5, 3)).astype(np.float32)
  on_devices = tree_digests({'x': jax.numpy.asarray(x)})['x']
  assert host_digest(x) == host_digest(x, chunk_elements=4 * 15) == on_devices   # 4-row pieces
  x[20, 1, 2] = np.nextafter(x[20, 1, 2], np.float32(np.inf))   # one ulp of one element
  assert host_digest(x, chunk_elements=4 * 15) != on_devices


def test_init_from_a_run_whose_newest_checkpoint_is_bad_starts_from_the_one_before(
    tmp_path, six_step_run, capsys):
  """One weight of the source's step 6 no longer matches its saved digest: init_from=run: says so
  as a resume would, and starts from step 4, the same weights as a source that never had step 6;
  nothing of the source is moved or changed."""
  config, straight = six_step_run
  source = _copy(straight, tmp_path)
  digests = source / 'checkpoints-digests' / '6.json'
  record = json.loads(digests.read_text())
  record['arrays']['params/blocks/mlp/down/kernel'] ^= 1
  digests.write_text(json.dumps(record))
  before = _files(source)
  fine_tune = lambda src: tiny_config(**{'train.steps': 1, 'init_from': f'run:{src}',
                                         'data.path': config.data.path})
  run.train_and_evaluate(fine_tune(source), str(tmp_path / 'tuned'))
  out = capsys.readouterr().out
  assert (f'checkpoint  {source}/checkpoints/6 does not restore (DigestMismatch: '
          f'params/blocks/mlp/down/kernel differs from what was saved') in out
  assert f'init        base weights from run {source} step 4' in out
  assert _files(source) == before
  pinned = shutil.copytree(straight, tmp_path / 'pinned')
  shutil.rmtree(pinned / 'checkpoints' / '6')
  run.train_and_evaluate(fine_tune(pinned), str(tmp_path / 'from4'))
  assert read_metrics(tmp_path / 'tuned')[0] == read_metrics(tmp_path / 'from4')[0]   # step 0


def test_when_no_checkpoint_restores_the_run_stops_and_changes_nothing(tmp_path, six_step_run):
  config, straight = six_step_run
  workdir = _copy(straight, tmp_path)
  for step in (2, 4, 6):
    CORRUPTIONS['garbage metadata'](workdir / 'checkpoints' / str(step))
  before = _files(workdir)
  with pytest.raises(CheckpointError, match=r'no checkpoint in .* restores \(step 6: .*step 4: .*'
                     r'step 2: .*\); nothing was changed'):
    run.train_and_evaluate(config, str(workdir))
  assert _files(workdir) == before


def test_a_second_run_on_a_live_runs_workdir_is_refused_in_one_line(tmp_path):
  workdir = tmp_path / 'w'
  with workdir_lock(str(workdir)):   # stands for the live run
    result = subprocess.run(
        [*python(), os.path.join(ROOT, 'main.py'), '--config=configs/default.py:tiny',
         '--dry_run', f'--workdir={workdir}'], cwd=ROOT, capture_output=True, text=True,
        env=child_environ(), timeout=300)
    assert result.returncode == 1 and 'Traceback' not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f'error: --workdir={workdir} is in use by a live run (pid {os.getpid()} on ')
    assert os.listdir(workdir) == ['.lock']
    with pytest.raises(WorkdirBusy):
      run.dry_run(tiny_config(), str(workdir))
  assert not workdir.exists()   # the lock's own folder goes with it when nothing else was written


LOCK_RACER = """
import os, sys
from train.workdir_lock import WorkdirBusy, workdir_lock
base, taken = sys.argv[1], 0
for _ in range(3000):
  try:
    with workdir_lock(os.path.join(base, 'w')):
      os.close(os.open(os.path.join(base, 'holder'), os.O_CREAT | os.O_EXCL))   # two holders: raises
      os.remove(os.path.join(base, 'holder'))
      taken += 1
  except WorkdirBusy:
    pass
print(taken)
"""


def test_two_processes_racing_for_an_empty_workdir_never_both_hold_its_lock(tmp_path):
  """Each takes and leaves the lock of a workdir it creates, thousands of times: the holder removes
  the folder as it leaves while the other is opening its lock file."""
  racers = [subprocess.Popen([sys.executable, '-c', LOCK_RACER, str(tmp_path)], cwd=ROOT, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
  for racer in racers:
    out, err = racer.communicate(timeout=300)
    assert racer.returncode == 0, err[-2000:]
    assert int(out) > 0
  assert os.listdir(tmp_path) == []   # nothing left behind: the workdir held only the lock


def test_checkpoint_minutes_saves_by_the_clock(tmp_path):
  config = tiny_config(**{'train.steps': 12, 'train.checkpoint_every': 1000,
                          'train.checkpoint_minutes': 1e-9, 'train.keep_checkpoints': 100,
                          'data.path': small_corpus(tmp_path)})
  run.train_and_evaluate(config, str(tmp_path / 'w'))
  assert sorted(map(int, os.listdir(tmp_path / 'w' / 'checkpoints'))) == list(range(1, 13))


# Every piece of training state, 8-bit moments and fp8 amax histories included.
STATE_OVERRIDES = {'quant.adam_bits': 8, 'quant.adam_block_size': 256, 'quant.mode': 'fp8',
                   'quant.fp8_scaling': 'delayed'}
LAYOUTS = {'fsdp': ('fsdp', None), 'ddp': ('ddp', None), 'fsdp_tp': ('fsdp_tp', None),
           'one device': ('ddp', 1)}


def _layout(name: str, corpus: str):
  config = layout_config(name, 'tiny')
  for key, value in {**STATE_OVERRIDES, 'data.path': corpus, 'train.steps': 3,
                     'train.checkpoint_every': 3}.items():
    section, field = key.split('.')
    config[section][field] = value
  return config


def _moment_values(s, state) -> dict:
  """Every Adam moment as the optimizer reads it (8-bit ones dequantized with `s`'s blocking), by
  path: equal values here mean the moments mean the same on this mesh."""
  shapes = {path: leaf.shape for path, leaf in run._flat_paths(state['params']).items()}
  values = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state['opt_state'],
                                                         is_leaf=is_quantized_moment)[0]:
    key = jax.tree_util.keystr(path, simple=True, separator='/')
    if not is_quantized_moment(leaf):
      values[key] = np.asarray(leaf)
      continue
    param = next(p for p in shapes if key.endswith('/' + p))
    axis, shape = s.block_axes[param], shapes[param]
    moved = (shape[axis],) + shape[:axis] + shape[axis + 1:]
    signed = '/mu/' in f'/{key}/'
    values[key] = np.moveaxis(np.asarray(dequantize_blockwise(leaf, moved, signed)), 0, axis)
  return values


def test_every_piece_of_state_restores_onto_every_layout_with_the_same_values(tmp_path):
  corpus = small_corpus(tmp_path)
  workdir = tmp_path / 'w'
  saved = run.train_and_evaluate(_layout('fsdp', corpus), str(workdir))
  assert saved
  checkpoints = Checkpointer(str(workdir / 'checkpoints'), keep=3)
  meta = checkpoints.read_meta(3)
  restored = {}
  for name, (layout, devices) in LAYOUTS.items():
    config = _layout(layout, corpus)
    s = run.setup(config, jax.devices()[:devices] if devices else None,
                  stored_block_axes=meta['adam_block_axes'])
    checkpoints.check_compatible(3, s.layout.abstract, run.checkpoint_meta(s))
    state, data = checkpoints.restore(3, s.layout.abstract)
    assert s.block_axes == meta['adam_block_axes']
    restored[name] = (s, jax.tree.map(np.asarray, state), data)
  checkpoints.close()
  s_same, same, data_same = restored['fsdp']
  assert len({tuple(r[0].mesh.shape.items()) for r in restored.values()}) == len(LAYOUTS)
  assert any(axis != 0 for axis in s_same.block_axes.values())   # fsdp blocks along a sharded dim
  histories = [k for k in run._flat_paths(same['params']) if k.endswith('amax_history')]
  assert histories and same['loss_scale'] and int(same['step']) == 3
  for name, (s, state, data) in restored.items():
    assert data == data_same, name
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(same)):
      np.testing.assert_array_equal(a, b, err_msg=name)
    moments, moments_same = _moment_values(s, state), _moment_values(s_same, same)
    assert moments.keys() == moments_same.keys()
    for key in moments:
      np.testing.assert_array_equal(moments[key], moments_same[key], err_msg=f'{name}: {key}')
