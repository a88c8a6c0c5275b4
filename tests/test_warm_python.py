"""The warm Python (tests/warm_python.py) runs a command as a new interpreter would: the same
arguments, path, directory, environment, streams and exit, signals passed on; and where the
environment differs from its own, in a new interpreter."""
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from tests import warm_python

PROBE = textwrap.dedent('''\
    import json, os, sys
    warm = 'jax' in sys.modules   # before anything here imports it
    print(json.dumps(dict(argv=sys.argv, path0=sys.path[0], cwd=os.getcwd(), name=__name__,
                          file=__file__, x=os.environ.get('PROBE_X'),
                          xla=os.environ.get('XLA_FLAGS'))))
    print(json.dumps(dict(warm=warm)), file=sys.stderr)
    if len(sys.argv) > 1 and sys.argv[1] == 'raise':
      raise ValueError('the probe failed on purpose')
    if len(sys.argv) > 1 and sys.argv[1] == 'wait':
      import signal
      signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))   # its own answer to a SIGTERM
      open('started', 'w').write(str(os.getpid()))
      import time
      time.sleep(60)
    sys.exit(3)
''')


def _probe(tmp_path):
  (tmp_path / 'pkg').mkdir()
  (tmp_path / 'pkg' / '__init__.py').write_text('')
  (tmp_path / 'pkg' / 'probe.py').write_text(PROBE)
  (tmp_path / 'probe.py').write_text(PROBE)
  return {**os.environ, 'PROBE_X': 'x'}


def _both(args, cwd, env):
  """(stdout, stderr, exit code) of `python ARGS` warm and in a new interpreter."""
  return [subprocess.run(prefix + args, cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=120) for prefix in (warm_python.command(env), [sys.executable])]


def test_a_script_and_a_module_run_warm_as_a_new_interpreter_runs_them(tmp_path):
  env = _probe(tmp_path)
  for args in (['probe.py', 'a', '--b=c'], ['-m', 'pkg.probe', 'a']):
    warm, cold = _both(args, tmp_path, {**env, 'XLA_FLAGS': '--xla_dump_to=x'})
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout) == (3, cold.stdout)
    assert json.loads(warm.stderr) == {'warm': True} and json.loads(cold.stderr) == {'warm': False}
    seen = json.loads(warm.stdout)
    assert seen['name'] == '__main__' and seen['x'] == 'x' and seen['xla'] == '--xla_dump_to=x'
    assert seen['cwd'] == str(tmp_path) and seen['path0'] == str(tmp_path)
    assert os.path.isabs(seen['file'])


def test_an_uncaught_exception_exits_one_with_its_traceback(tmp_path):
  env = _probe(tmp_path)
  warm, cold = _both(['probe.py', 'raise'], tmp_path, env)
  assert warm.returncode == cold.returncode == 1
  for result in (warm, cold):
    assert 'Traceback' in result.stderr
    assert result.stderr.strip().endswith('ValueError: the probe failed on purpose')


def test_an_environment_that_differs_runs_in_a_new_interpreter(tmp_path):
  env = _probe(tmp_path)
  prefix = warm_python.command(env)
  result = subprocess.run(prefix + ['probe.py'], cwd=tmp_path, env={**env, 'JAX_ENABLE_X64': '1'},
                          capture_output=True, text=True, timeout=120)
  assert result.returncode == 3 and json.loads(result.stderr) == {'warm': False}


def _started(tmp_path, client) -> int:
  deadline = time.monotonic() + 60
  while not (tmp_path / 'started').exists():
    assert client.poll() is None and time.monotonic() < deadline, client.communicate()
    time.sleep(0.05)
  time.sleep(0.1)   # the file is written before its pid is
  return int((tmp_path / 'started').read_text())


def _gone(pid: int) -> bool:
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    try:
      os.kill(pid, 0)
    except ProcessLookupError:
      return True
    time.sleep(0.05)
  return False


def test_a_signal_to_the_client_reaches_the_command_and_a_kill_kills_it(tmp_path):
  """SIGTERM reaches the command, whose handler exits 7; SIGKILL cannot be passed on, and the
  server kills the command when the client's end closes."""
  env = _probe(tmp_path)
  for sent, code in ((signal.SIGTERM, 7), (signal.SIGKILL, -signal.SIGKILL)):
    client = subprocess.Popen(warm_python.command(env) + ['probe.py', 'wait'], cwd=tmp_path,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child = _started(tmp_path, client)
    assert child != client.pid
    client.send_signal(sent)
    client.communicate(timeout=60)
    assert client.returncode == code
    assert _gone(child)
    (tmp_path / 'started').unlink()
