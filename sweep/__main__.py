"""Run a sweep, resume it, and turn it into tables and charts.

  python -m sweep --sweep=sweeps/NAME.py[:arg] --workdir=DIR [--parallel=N] [--only=REGEX]

Each point runs in its own process and workdir under DIR/runs; a re-run of the same command skips
finished points, runs failed and interrupted ones again, and rewrites DIR/results.csv,
DIR/results.md and the sweep's charts from every point's files.
"""
import os
import re
import shlex
import signal
import sys

from absl import app, flags

_SWEEP = flags.DEFINE_string('sweep', None, 'Sweep file[:arg], e.g. sweeps/precision.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The sweep\'s directory (one workdir per point '
                               'under it); the same one resumes.')
_PARALLEL = flags.DEFINE_integer('parallel', 1, 'Points run at once.')
_ONLY = flags.DEFINE_string('only', None, 'Run only the points whose name matches this regex '
                            '(results still list every point).')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]}')
  if not _SWEEP.value or not _WORKDIR.value:
    sys.exit('error: --sweep=sweeps/NAME.py and --workdir=DIR are both required')
  if _PARALLEL.value < 1:
    sys.exit(f'error: --parallel={_PARALLEL.value}; it must be a positive integer')
  # Ctrl-C, and a job scheduler's SIGTERM, stop the points cleanly, even where the shell that
  # started this process made it ignore SIGINT (a background job).
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, signal.default_int_handler)
  # This process only checks configs: it must not take an accelerator's memory from its points.
  os.environ.setdefault('XLA_PYTHON_CLIENT_PREALLOCATE', 'false')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from sweep.grid import SweepError
  from sweep.runner import Job, Runner, data_directories, prepare_data, run_jobs
  from sweep import report, spec
  from data import DataError
  from train.workdir_lock import WorkdirBusy, workdir_lock

  directory = _WORKDIR.value
  try:
    sweep = spec.load(_SWEEP.value)
    only = None
    if _ONLY.value is not None:
      try:
        only = re.compile(_ONLY.value)
      except re.error as e:
        raise SweepError(f'--only={_ONLY.value!r} is not a regular expression: {e}') from None
    spec.check(sweep)
    selected = [p for p in sweep.points if only is None or only.search(p.name)]
    if not selected:
      raise SweepError(f'--only={_ONLY.value!r} matches none of the {len(sweep.points)} points, '
                       f'e.g. {sweep.points[0].name}')
    command = ' '.join(['python -m sweep', *map(shlex.quote, sys.argv[1:])])
    with workdir_lock(directory):
      data_paths = data_directories(sweep, directory)
      jobs = [Job(sweep, p, directory, data_paths) for p in [*sweep.before.values(), *selected]]
      states = [job.state() for job in jobs]    # refuses a foreign or changed workdir up front
      todo = [job for job, state in zip(jobs, states) if state != 'done']
      if todo:
        prepare_data(data_paths)
      print(f'sweep       {sweep.title}: {len(sweep.points)} points ({sweep.command}), '
            f'{len(jobs) - len(todo)} finished, {len(todo)} to run, {_PARALLEL.value} at a time')
      try:
        run_jobs(todo, Runner(_PARALLEL.value))
      except KeyboardInterrupt:
        sys.exit('interrupted: the points that were running are recorded as interrupted; the same '
                 'command resumes the sweep')
      table = report.write(sweep, directory, command)
  except (SweepError, DataError, WorkdirBusy) as e:
    sys.exit(f'error: {e}')
  done = sum(r['status'] == 'done' for r in table)
  failed = [r for r in table if r['status'] == 'failed']
  print(f'results     {done} of {len(table)} points done, {len(failed)} failed: '
        f'{os.path.join(directory, "results.md")}, results.csv'
        + ''.join(f', {c["file"]}' for c in sweep.charts))
  if failed:
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
