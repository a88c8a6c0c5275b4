"""Run a sweep, resume it, and turn it into tables and charts.

  python -m sweep --sweep=sweeps/NAME.py[:arg] --workdir=DIR [--parallel=N] [--only=REGEX]

Each point runs in its own process and workdir under DIR/runs; a re-run of the same command skips
finished points, runs failed and interrupted ones again, and rewrites DIR/results.csv,
DIR/results.md and the sweep's charts from every point's files.
"""
import os
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
  from parallel.xla_flags import cuda_plugin_without_gpu
  if cuda_plugin_without_gpu():   # installed for --target: JAX would try it, and print a traceback
    os.environ.setdefault('JAX_PLATFORMS', 'cpu')
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from data import DataError
  from sweep.grid import SweepError
  from sweep.session import run_sweep
  from train.workdir_lock import WorkdirBusy

  command = ' '.join(['python -m sweep', *map(shlex.quote, sys.argv[1:])])
  try:
    _, table = run_sweep(_SWEEP.value, _WORKDIR.value, command, _PARALLEL.value, _ONLY.value)
  except KeyboardInterrupt:
    sys.exit('interrupted: the points that were running are recorded as interrupted; the same '
             'command resumes the sweep')
  except (SweepError, DataError, WorkdirBusy) as e:
    sys.exit(f'error: {e}')
  if any(r['status'] == 'failed' for r in table):
    sys.exit(1)

if __name__ == '__main__':
  app.run(main)
