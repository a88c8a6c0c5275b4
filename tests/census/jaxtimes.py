"""A pytest plugin (`-p jaxtimes`, with tests/census on PYTHONPATH): per test, the worker's CPU
seconds, JAX's compile events, the test's start time and its worker, appended to $SUITE_CENSUS as
sitecustomize.py does for the processes a test starts; and the CPU of the worker's children
reaped during the test (`children_cpu_s`, RUSAGE_CHILDREN: processes killed by a signal, ptxas,
Ray's and Inductor's workers, which write no line of their own, but also a warm-Python server
stopped then with all it served, so a file's figure is not its own alone)."""
import collections
import json
import os
import resource
import time

import pytest

_EVENTS = collections.Counter()
_LISTENING = []
_COMPILES = []   # (the program's key, seconds) of each backend compile in this test


def _record_compiles():
  """Wraps JAX's backend compile so that each compile of this worker is keyed by its program
  (tests/compile_memo.py:program_key): the seconds of the keys seen before in the same worker are
  what the workers' memo serves. Run with SUITE_COMPILE_MEMO=0 to see them; with the memo on, its
  hits are recorded too, at the seconds they took (none to speak of)."""
  from jax._src import compiler
  from tests.compile_memo import program_key
  compile_and_load = compiler.backend_compile_and_load

  def keyed(backend, module, executable_devices, options, *args, **kwargs):
    start = time.perf_counter()
    out = compile_and_load(backend, module, executable_devices, options, *args, **kwargs)
    client, devices, digest = program_key(backend, module, executable_devices, options)
    key = f'{client}:{",".join(map(str, devices))}:{digest.hex()}'
    _COMPILES.append((key, time.perf_counter() - start))
    return out
  compiler.backend_compile_and_load = keyed


def _cpu(who=resource.RUSAGE_SELF) -> float:
  usage = resource.getrusage(who)
  return usage.ru_utime + usage.ru_stime


def _record_servers():
  """Wraps the warm Python's stop (tests/warm_python.py) so that each server stopped writes the
  CPU of its whole subtree, itself and every command it served, which its reaping adds to this
  worker's RUSAGE_CHILDREN: the servers are ended by SIGTERM and write no line of their own."""
  from tests import warm_python
  stop = warm_python._stop

  def measured(process, directory):
    before, start = _cpu(resource.RUSAGE_CHILDREN), time.time()
    stop(process, directory)
    with open(os.environ.get('SUITE_CENSUS', '/tmp/suite-census.jsonl'), 'a') as f:
      f.write(json.dumps({'kind': 'server', 'worker': os.environ.get('PYTEST_XDIST_WORKER', 'main'),
                          'subtree_cpu_s': _cpu(resource.RUSAGE_CHILDREN) - before,
                          'at': start}) + '\n')
  warm_python._stop = measured


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
  if not _LISTENING:
    _record_servers()
    from jax._src import monitoring
    monitoring.register_event_duration_secs_listener(
        lambda event, seconds, **_: _EVENTS.update({event: seconds}))
    _LISTENING.append(True)
    _record_compiles()
  _EVENTS.clear()
  _COMPILES.clear()
  cpu, children, start = _cpu(), _cpu(resource.RUSAGE_CHILDREN), time.time()
  yield
  with open(os.environ.get('SUITE_CENSUS', '/tmp/suite-census.jsonl'), 'a') as f:
    f.write(json.dumps({'kind': 'test', 'test': item.nodeid, 'cpu_s': _cpu() - cpu,
                        'children_cpu_s': _cpu(resource.RUSAGE_CHILDREN) - children,
                        'wall_s': time.time() - start, 'events_s': dict(_EVENTS),
                        'start': start, 'worker': os.environ.get('PYTEST_XDIST_WORKER', 'main'),
                        'compiles': list(_COMPILES)})
            + '\n')
