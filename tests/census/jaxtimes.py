"""A pytest plugin (`-p jaxtimes`, with tests/census on PYTHONPATH): per test, the worker's CPU
seconds, JAX's compile events, the test's start time and its worker, appended to $SUITE_CENSUS as
sitecustomize.py does for the processes a test starts."""
import collections
import json
import os
import resource
import time

import pytest

_EVENTS = collections.Counter()
_LISTENING = []


def _cpu() -> float:
  usage = resource.getrusage(resource.RUSAGE_SELF)
  return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  if not _LISTENING:
    from jax._src import monitoring
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: _EVENTS.update({event: seconds}))
    _LISTENING.append(True)
  _EVENTS.clear()
  cpu, start = _cpu(), time.time()
  yield
  with open(os.environ.get('SUITE_CENSUS', '/tmp/suite-census.jsonl'), 'a') as f:
    f.write(json.dumps({'kind': 'test', 'test': item.nodeid, 'cpu_s': _cpu() - cpu,
                        'wall_s': time.time() - start, 'events_s': dict(_EVENTS),
                        'start': start, 'worker': os.environ.get('PYTEST_XDIST_WORKER', 'main')})
            + '\n')
