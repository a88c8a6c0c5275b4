"""Where the suite's time goes, per process: with this folder on PYTHONPATH, every Python process
the suite starts (main.py, the bench modules, their workers) appends one JSON line to
$SUITE_CENSUS (default /tmp/suite-census.jsonl) as it exits: its command, the test that started
it, its CPU seconds and JAX's compile events (trace, lowering, backend compile), summed.

  PYTHONPATH=tests/census python -m pytest -n 2 -q -p jaxtimes   # jaxtimes.py: the tests' own
  python tests/census/summary.py                                  # per test file

Python imports `sitecustomize` from the path at start-up, and this imports jax there (to listen
before anything compiles): a process that sets JAX's environment variables itself is measured
under those it started with. A process killed by a signal writes nothing. A measuring tool only:
the suite never loads it."""
import atexit
import collections
import json
import os
import resource
import sys
import time

_START = time.time()
_EVENTS = collections.Counter()


def _listen(event: str, seconds: float, **_) -> None:
  _EVENTS[event] += seconds


from jax._src import monitoring   # noqa: E402  (the duration events have no public listener API)
monitoring.register_event_duration_secs_listener(_listen)


@atexit.register
def _write() -> None:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  if 'pytest' in sys.modules:   # the suite's own processes: jaxtimes.py measures them per test;
    # here their whole life, and all they reaped (registered first, this runs last of the exit's
    # handlers: after the warm servers are stopped)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(os.environ.get('SUITE_CENSUS', '/tmp/suite-census.jsonl'), 'a') as f:
      f.write(json.dumps({'kind': 'pytest', 'worker': os.environ.get('PYTEST_XDIST_WORKER', 'main'),
                          'cpu_s': usage.ru_utime + usage.ru_stime,
                          'children_cpu_s': children.ru_utime + children.ru_stime,
                          'wall_s': time.time() - _START}) + '\n')
    return
  with open(os.environ.get('SUITE_CENSUS', '/tmp/suite-census.jsonl'), 'a') as f:
    f.write(json.dumps({'kind': 'process', 'argv': sys.argv[:12],
                        'test': os.environ.get('PYTEST_CURRENT_TEST', '').split(' ')[0],
                        'cpu_s': usage.ru_utime + usage.ru_stime, 'wall_s': time.time() - _START,
                        'events_s': dict(_EVENTS)}) + '\n')
