"""Runs a sweep's points: each in its own process and workdir (`DIR/runs/<point name>`), at most
`parallel` at a time, the `before` runs first (`DIR/before/<name>`).

Each workdir keeps the sweep's record of its point in `sweep.json` (status, the settings it was run
with, the command, wall time, the last error line) and the run's output in `log.txt`. On a re-run
a finished point is skipped, a failed or interrupted one runs again (a training run resumes from
its checkpoints), and a point whose recorded settings differ from the sweep file's is refused before
anything starts. Ctrl-C stops the running points (SIGTERM: a training run saves a checkpoint) and
records them as interrupted; nothing else is written.

Training points read one copy of their data: a glob (or the embedded corpus) is prepared once into
`DIR/data` and every point is given the prepared directory.
"""
import concurrent.futures
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

from sweep.grid import FLAG_KEYS, Point, SweepError
from sweep.spec import ROOT, Sweep, config_of, project_path
from train.metrics import read_rows

STATUS_FILE = 'sweep.json'
LOG_FILE = 'log.txt'
STOP_GRACE_SECONDS = 120


def point_workdir(directory: str, point: Point) -> str:
  before = point.labels.get('before')
  return os.path.join(directory, 'before', before) if before else os.path.join(
      directory, 'runs', point.name)


def read_status(workdir: str) -> dict | None:
  try:
    with open(os.path.join(workdir, STATUS_FILE), encoding='utf-8') as f:
      return json.load(f)
  except FileNotFoundError:
    return None


def _write_status(workdir: str, record: dict) -> None:
  path = os.path.join(workdir, STATUS_FILE)
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    json.dump(record, f, indent=2)
    f.write('\n')
  os.replace(path + '.tmp', path)


def _text(value) -> str:
  return str(value)   # True/False, numbers and strings as absl's config flags parse them


class Job:
  """One point of the sweep (or a before run): its settings, workdir and command line."""

  def __init__(self, sweep: Sweep, point: Point, directory: str, data_paths: dict):
    self.point, self.workdir = point, point_workdir(directory, point)
    self.command = 'train' if point.labels.get('before') else sweep.command
    spec, overrides = sweep.settings(point)
    self.settings = {'command': self.command, 'config': spec, 'overrides': overrides}
    config = config_of(sweep, point)
    self.steps = config.train.steps
    refs = {name: os.path.abspath(point_workdir(directory, p)) for name, p in sweep.before.items()}
    path, _, arg = spec.partition(':')
    config_flag = os.path.abspath(project_path(path)) + (f':{arg}' if arg else '')
    if self.command == 'bench':
      argv = [sys.executable, '-m', 'bench.train_step', f'--config={config_flag}']
    else:
      argv = [sys.executable, os.path.join(ROOT, 'main.py'), f'--config={config_flag}']
    for key, value in overrides.items():
      if key == 'target' and self.command == 'plan':   # below
        continue
      if key in FLAG_KEYS:
        argv.append(f'{FLAG_KEYS[key]}={_text(value)}')
        continue
      if isinstance(value, str):
        value = re.sub(r'\{(\w+)\}', lambda m: refs.get(m[1], m[0]), value)
      argv.append(f'--config.{key}={_text(value)}')
    from data.source import source_key
    data_key = source_key(config.data)
    if self.command == 'train' and data_key in data_paths:
      argv.append(f'--config.data.path={data_paths[data_key]}')
    workdir = os.path.abspath(self.workdir)
    argv += {'train': [f'--workdir={workdir}'],
             'dry_run': [f'--workdir={workdir}', '--dry_run'],
             'plan': [f'--workdir={workdir}', '--plan', f'--target={overrides.get("target")}'],
             'bench': [f'--out={os.path.join(workdir, "bench.json")}']}[self.command]
    self.argv = argv

  def state(self) -> str:
    """new | done | failed | interrupted | running (a sweep that died: runs again);
    SweepError for a directory that is not this point's."""
    record = read_status(self.workdir)
    if record is None:
      if os.path.exists(self.workdir):
        raise SweepError(f'{self.workdir} exists but is not a point of a sweep (no {STATUS_FILE}); '
                         f'move it away or use another --workdir')
      return 'new'
    if record.get('settings') != self.settings:
      raise SweepError(f'{self.workdir} was run with other settings ({record.get("settings")}) '
                       f'than the sweep file now gives it ({self.settings}); use another --workdir '
                       f'or restore the sweep file')
    return record['status']

  def complete(self) -> bool:
    """Whether the run left what its command promises (a training run: its last step logged)."""
    if self.command == 'train':
      rows = read_rows(os.path.join(self.workdir, 'metrics.jsonl'))
      return any(row.get('step') == self.steps for row in rows)
    name = {'dry_run': 'memory.json', 'plan': 'plan.json', 'bench': 'bench.json'}[self.command]
    return os.path.isfile(os.path.join(self.workdir, name))


def last_error_line(text: str) -> str:
  """The line that says why a run failed: its `error:` line, else an exception's last line."""
  lines = [line.strip() for line in text.splitlines() if line.strip()]
  for line in reversed(lines):
    if line.startswith('error:') or re.match(r'^[\w.]+(Error|Exception|Interrupt)\b', line):
      return line[:300]
  return lines[-1][:300] if lines else 'no output'


class Runner:
  """Runs jobs (and any command: run_logged) in child processes; stop() ends the running ones
  (Ctrl-C). The one way this project runs a child process into a log: the sweep's points, and
  bench/gpu.py's claim."""

  def __init__(self, parallel: int):
    self.parallel = parallel
    self.stopping = threading.Event()
    self.children: set[subprocess.Popen] = set()
    self.lock = threading.Lock()
    self.env = dict(os.environ, PYTHONUNBUFFERED='1')
    if parallel > 1:   # points share the accelerator: none may take most of its memory up front
      self.env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'false'

  def run(self, job: Job) -> dict:
    os.makedirs(job.workdir, exist_ok=True)
    started = time.time()
    record = {'status': 'running', 'settings': job.settings, 'argv': job.argv,
              'started': datetime.datetime.now().isoformat(timespec='seconds')}
    _write_status(job.workdir, record)
    returncode, error = self.run_logged(job.argv, os.path.join(job.workdir, LOG_FILE))
    if self.stopping.is_set():
      status = 'interrupted'
    elif returncode == 0 and job.complete():
      status = 'done'
    else:
      status = 'failed'
    record.update(status=status, returncode=returncode, wall_s=round(time.time() - started, 1),
                  finished=datetime.datetime.now().isoformat(timespec='seconds'))
    if status == 'failed':
      record['error'] = (error if returncode else
                         f'exited 0 without {"its last step" if job.command == "train" else "its output file"}')
    _write_status(job.workdir, record)
    return record

  def run_logged(self, argv: list[str], log_path: str, env: dict | None = None) -> tuple[int, str]:
    """Runs `argv` in the project root, in a session of its own, with its output appended to
    `log_path` after a line with the time and the command; (exit status, the line that says why it
    failed, or '' when it exited 0). Once the runner is stopping nothing starts (status -1), and
    stop() ends what runs. `env`: the child's whole environment (default the runner's)."""
    with open(log_path, 'a', encoding='utf-8') as log:
      log.write(f'\n=== {datetime.datetime.now().isoformat(timespec="seconds")}: '
                f'{shlex.join(argv)}\n')
      log.flush()
      offset = log.tell()
      with self.lock:
        if self.stopping.is_set():
          child = None
        else:
          child = subprocess.Popen(argv, cwd=ROOT, env=self.env if env is None else env,
                                   stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
          self.children.add(child)
      returncode = -1 if child is None else child.wait()
    with self.lock:
      self.children.discard(child)
    if not returncode:
      return 0, ''
    with open(log_path, encoding='utf-8', errors='replace') as f:
      f.seek(offset)
      return returncode, last_error_line(f.read())

  def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
    """SIGTERM to every running child (a training run saves a checkpoint and exits), SIGKILL to
    any still running after `grace` seconds."""
    self.stopping.set()
    with self.lock:
      children = list(self.children)
    for child in children:
      try:
        os.killpg(child.pid, signal.SIGTERM)
      except ProcessLookupError:
        pass
    deadline = time.time() + grace
    for child in children:
      try:
        child.wait(timeout=max(deadline - time.time(), 0))
      except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)

  def interrupt(self) -> None:
    """What Ctrl-C does: stop() the running children; a second Ctrl-C kills them at once."""
    try:
      self.stop()
    except KeyboardInterrupt:
      self.stop(grace=0)


def data_directories(sweep: Sweep, directory: str) -> dict:
  """Where each distinct data.path of the training points that is not already prepared will be
  prepared, once, under DIR/data: {data/source.py:SourceKey: directory}. Writes nothing. (A
  mixture's sources are prepared by each point's run, in its own workdir.)"""
  from data.source import cache_directory, is_prepared_path, source_key, sources_of
  out = {}
  for point in [*sweep.before.values(), *sweep.points]:
    if sweep.command != 'train' and not point.labels.get('before'):
      continue
    data = config_of(sweep, point).data
    key = source_key(data)
    if key not in out and not is_prepared_path(data.path) and sources_of(data.path)[0].name == '':
      out[key] = os.path.abspath(cache_directory(os.path.join(directory, 'data'), key))
  return out


def prepare_data(directories: dict) -> None:
  """Prepares what data_directories planned (a finished preparation is kept as it is)."""
  from data.source import open_data
  for key, prepared in directories.items():
    open_data(key, os.path.dirname(prepared))


def run_jobs(jobs: list[Job], runner: Runner, progress: bool = True) -> list[dict]:
  """Runs `jobs` (before runs first, one at a time: the grid may need them), the rest `parallel`
  at a time, with a progress bar; returns their records. KeyboardInterrupt stops them."""
  from tqdm import tqdm
  records = []
  bar = tqdm(total=len(jobs), unit='point', disable=not progress, dynamic_ncols=True)
  failed = 0

  def finished(job, record):
    nonlocal failed
    records.append(record)
    if record['status'] == 'failed':
      failed += 1
      bar.write(f'failed  {job.point.name}: {record["error"]}')
    elif record['status'] == 'done':
      bar.write(f'done    {job.point.name} ({record["wall_s"]:.0f} s)')
    bar.set_postfix_str(f'{failed} failed')
    bar.update(1)

  first = [j for j in jobs if j.point.labels.get('before')]
  rest = [j for j in jobs if not j.point.labels.get('before')]
  pool = concurrent.futures.ThreadPoolExecutor(max_workers=runner.parallel)
  try:
    for job in first:
      record = runner.run(job)
      finished(job, record)
      if record['status'] != 'done':
        raise SweepError(f'before run {job.point.labels["before"]} failed ({record.get("error")}); '
                         f'the grid needs it: fix it and run the sweep again (log: '
                         f'{os.path.join(job.workdir, LOG_FILE)})')
    futures = {pool.submit(runner.run, job): job for job in rest}
    for future in concurrent.futures.as_completed(futures):
      finished(futures[future], future.result())
  except KeyboardInterrupt:
    bar.write('interrupted: stopping the running points (a second Ctrl-C kills them)')
    pool.shutdown(wait=False, cancel_futures=True)
    runner.interrupt()
    pool.shutdown(wait=True)
    raise
  finally:
    pool.shutdown(wait=True)
    bar.close()
  return records
