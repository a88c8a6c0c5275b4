"""Preparing on Ray (`python -m data.prepare ... --engine=ray`): the plan's groups run as Ray tasks,
on a Ray started here for this preparation (`--workers` CPUs) or on a running cluster
(`--ray_address`, e.g. `auto` on one of its nodes, or `ray://HOST:10001`).

A task is `prepare_group` itself, so the shards, group records and index are byte for byte the
local engine's, and the semantics are the same: a group's files appear under their final names only
when complete, a finished group (its record on disk) is not run again, a bad record fails its group
(not retried: the data would fail again) and stops the preparation with the same one line. A task
whose worker dies (a killed process, a lost node) is run again by Ray, up to RETRIES times; what it
had half-written stays under a temporary name, removed when the preparation ends. On a cluster the
inputs, `--out` and a tokenizer directory must be at the same paths on every node (a shared file
system), and the project importable there (its root is put on the workers' PYTHONPATH).

Ray is optional: `pip install "ray>=2.9"`; without it `--engine=ray` is refused in one line before
anything is written.
"""
import contextlib
import logging
import os

from data.corpus import DataError

RETRIES = 3   # runs of a group's task after the first, where its worker died
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def require_ray():
  """The ray module, or DataError in one line naming the install."""
  try:
    import ray
  except ImportError:
    raise DataError('--engine=ray needs Ray, which is not installed: pip install "ray>=2.9" '
                    '(or use --engine=local)') from None
  return ray


@contextlib.contextmanager
def ray_groups(run_group, jobs: list, workers: int, address: str | None):
  """An iterator of `run_group(job)`'s results, in the order they finish, each job a Ray task; the
  Ray this starts (none where one is running in this process) is shut down on leaving."""
  ray = require_ray()
  started = not ray.is_initialized()
  if started:
    # 'local': a Ray of its own, even where a cluster runs on this machine (which Ray would join).
    ray.init(address=address or 'local', num_cpus=None if address else workers,
             include_dashboard=False,
             log_to_driver=False, logging_level=logging.ERROR,
             runtime_env={'env_vars': {'PYTHONPATH': os.pathsep.join(
                 p for p in (ROOT, os.environ.get('PYTHONPATH')) if p)}})
  task = ray.remote(num_cpus=1, max_retries=RETRIES)(run_group)
  pending = [task.remote(job) for job in jobs]

  def results():
    nonlocal pending
    while pending:
      (done,), pending = ray.wait(pending, num_returns=1)
      try:
        yield ray.get(done)
      except ray.exceptions.RayTaskError as e:   # the group's own error, as the local one raises
        raise (e.cause if isinstance(e.cause, BaseException) else e) from None
      except ray.exceptions.RayError as e:   # a worker, node or object lost past the retries
        raise DataError(f'a group of the preparation failed on Ray ({type(e).__name__}, after up '
                        f'to {RETRIES} retries of its task); run the same command again to resume'
                        ) from None

  try:
    yield results()
  finally:
    for ref in pending:
      ray.cancel(ref, force=True)
    if started:
      ray.shutdown()
