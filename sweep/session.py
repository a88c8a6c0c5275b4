"""One sweep in one directory, start to finish: the sweep file loaded and every point checked, the
directory locked, the points not yet done run (the `before` runs first), and the results written.
`python -m sweep` and `python -m bench.gpu` both run their sweeps through `run_sweep`."""
import os
import re

from sweep import report, spec
from sweep.grid import SweepError
from sweep.runner import Job, Runner, data_directories, prepare_data, run_jobs


def run_sweep(sweep_spec: str, directory: str, command: str, parallel: int = 1,
              only: str | None = None) -> tuple[spec.Sweep, list[dict]]:
  """(the sweep, its results table). `command`: the command line quoted in results.md; `only`: a
  regex over point names (the results still list every point). Raises SweepError, DataError or
  WorkdirBusy before anything runs; KeyboardInterrupt once the running points are stopped."""
  from train.workdir_lock import workdir_lock
  sweep = spec.load(sweep_spec)
  pattern = None
  if only is not None:
    try:
      pattern = re.compile(only)
    except re.error as e:
      raise SweepError(f'--only={only!r} is not a regular expression: {e}') from None
  spec.check(sweep)
  selected = [p for p in sweep.points if pattern is None or pattern.search(p.name)]
  if not selected:
    raise SweepError(f'--only={only!r} matches none of the {len(sweep.points)} points, '
                     f'e.g. {sweep.points[0].name}')
  with workdir_lock(directory):
    data_paths = data_directories(sweep, directory)
    jobs = [Job(sweep, p, directory, data_paths) for p in [*sweep.before.values(), *selected]]
    states = [job.state() for job in jobs]    # refuses a foreign or changed workdir up front
    todo = [job for job, state in zip(jobs, states) if state != 'done']
    if todo:
      prepare_data(data_paths)
    print(f'sweep       {sweep.title}: {len(sweep.points)} points ({sweep.command}), '
          f'{len(jobs) - len(todo)} finished, {len(todo)} to run, {parallel} at a time')
    run_jobs(todo, Runner(parallel))
    table = report.write(sweep, directory, command)
  print(f'results     {sum(r["status"] == "done" for r in table)} of {len(table)} points done, '
        f'{sum(r["status"] == "failed" for r in table)} failed: '
        f'{os.path.join(directory, "results.md")}, results.csv'
        + ''.join(f', {c["file"]}' for c in sweep.charts))
  return sweep, table
