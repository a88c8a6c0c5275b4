"""A Python that has imported JAX and the libraries already, for the commands the suite starts.

Each `python main.py ...` or `python -m MODULE ...` the suite starts spends its first second
importing JAX, Flax, optax, orbax, grain and the project (the tiny preset's dry run, 2-core AMD
EPYC: 2.6 s of CPU in a new interpreter, 1.4 s here, as the server's wait4 counts it), and the
suite starts about 150. A server, started once per worker and environment (`command()`), imports
them, then forks a child for each command: the child takes the command's arguments, working
directory, environment, ignored signals and standard streams, and runs its script or module as
`__main__`, as `python` would. It is a process of its own, so its exit code, its output and its
files are the command's; the client (tests/warm_client.py) that the shell starts in python's place
passes signals on to it and exits as it does.

What differs from a new interpreter: the modules below are imported already, and every child of
a server has its hash seed (so sets of strings iterate alike in two runs of one test). A command
whose environment differs from the server's in a variable that those modules may read at import
(any but READ_LATER), or that gives python an option of its own, is refused and runs in a new
interpreter instead. The project's modules come from this checkout, as they do for every command
the suite starts (a guide's scratch directory links `configs/` to it); no backend is started (XLA
reads its flags when one starts, in the child).

`python -m tests.warm_python SOCKET`: serves on the Unix socket SOCKET until its parent exits.
"""
import atexit
import builtins
import importlib
import json
import os
import re
import runpy
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLIENT = os.path.join(ROOT, 'tests', 'warm_client.py')
# Variables read after the imports (by the command itself, or by XLA when its backend starts), by
# the shell, by pytest (the running test's name) or by the client only (WARM_PYTHON_SAYS=1: a
# refused command says why, on its stderr): they may differ between the server and a command.
READ_LATER = frozenset({'XLA_FLAGS', 'PWD', 'OLDPWD', 'SHLVL', '_', 'PYTEST_CURRENT_TEST',
                        'WARM_PYTHON_SAYS'})
HEADER = 8   # bytes of a message's length, before its JSON
ENABLED = os.environ.get('SUITE_WARM_PYTHON', '1') != '0'   # SUITE_WARM_PYTHON=0: every one anew
SERVERS = 2   # kept per worker (about 230 MB each): the suite's own environment and the guides'


# What the commands import before their own work, main.py's in its order: the libraries, the
# CUDA plugin the backend's start imports where it is installed, and the project's library (which
# imports configs/default.py and configs/hardware.py from the project).
PRELOADED = ('absl.app', 'absl.flags', 'absl.logging', 'ml_collections.config_flags', 'numpy',
             'jax', 'jax.numpy', 'flax.linen', 'optax', 'orbax.checkpoint', 'grain',
             'train.checks', 'train.run', 'train.loop', 'train.checkpoint', 'train.init_from',
             'train.workdir_lock', 'train.collector', 'parallel.peers')
WHERE_INSTALLED = ('jax_plugins.xla_cuda12',)


def preload() -> None:
  from train import imports   # flax.nnx without IPython, as main.py has it (the rule's one place)
  imports.flax_nnx()
  for module in PRELOADED:
    importlib.import_module(module)
  for module in WHERE_INSTALLED:
    try:
      importlib.import_module(module)
    except ImportError:
      pass
  from jax._src import xla_bridge
  assert not xla_bridge._backends, 'a backend started while importing: XLA_FLAGS would be read'


def refusal(request: dict, started: dict) -> str | None:
  """Why `request` must run in a new interpreter, or None, where the server's environment was
  `started` before its imports (the client has refused python's own options already)."""
  keys = (set(request['env']) | set(started)) - READ_LATER
  differ = sorted(k for k in keys if request['env'].get(k) != started.get(k))
  return f'environment differs in {differ}' if differ else None


def send(conn: socket.socket, message: dict) -> None:
  """`message` to a client, unless it is gone (killed: its child goes too, when its end closes)."""
  data = json.dumps(message).encode()
  try:
    conn.sendall(len(data).to_bytes(HEADER, 'big') + data)
  except OSError:
    pass


def receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
  """A request, its signals ignored and the three standard streams sent with it; (None, []) where
  the client closed, failed or went quiet first (any streams it sent are closed)."""
  data, fds = b'', []
  conn.settimeout(30)   # a client that sends nothing holds up the others for no longer
  try:
    while len(data) < HEADER or len(data) < HEADER + int.from_bytes(data[:HEADER], 'big'):
      chunk, got, _, _ = socket.recv_fds(conn, 1 << 20, 3)
      fds += got
      if not chunk:
        raise EOFError
      data += chunk
  except (OSError, EOFError):
    for fd in fds:
      os.close(fd)
    return None, []
  conn.settimeout(None)
  return json.loads(data[HEADER:]), fds


def serve(path: str, started: dict) -> dict:
  """Forks a child per request until the parent exits; returns (in the child) its request.
  `started`: the environment before the imports."""
  listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
  listener.bind(path + '.binding')
  listener.listen(16)
  os.rename(path + '.binding', path)   # a client that finds the path finds it listening
  parent, selector = os.getppid(), selectors.DefaultSelector()
  children = {}   # a child's pidfd -> its pid and its client's connection
  selector.register(listener, selectors.EVENT_READ, ('accept', None))
  while os.getppid() == parent:
    for key, _ in selector.select(timeout=1.0):
      event, pidfd = key.data
      if event == 'accept':
        conn, _ = listener.accept()
        request, fds = receive(conn)
        reason = 'a torn request' if request is None or len(fds) != 3 else refusal(request, started)
        if reason:
          send(conn, {'refused': reason})
          conn.close()
          for fd in fds:
            os.close(fd)
          continue
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
          selector.close()
          for other in [listener, conn, *(c for _, c in children.values())]:
            other.close()
          for fd in children:
            os.close(fd)
          return dict(request, fds=fds)
        for fd in fds:
          os.close(fd)
        try:
          pidfd = os.pidfd_open(pid)
        except OSError as e:   # no pidfds here: the child goes, and the client runs it anew
          os.kill(pid, signal.SIGKILL)
          os.waitpid(pid, 0)
          send(conn, {'refused': f'pidfd_open: {e}'})
          conn.close()
          continue
        children[pidfd] = (pid, conn)
        selector.register(pidfd, selectors.EVENT_READ, ('exited', pidfd))
        selector.register(conn, selectors.EVENT_READ, ('client closed', pidfd))
        send(conn, {'pid': pid})
      elif event == 'exited':
        pid, conn = children.pop(pidfd)
        selector.unregister(pidfd)
        os.close(pidfd)
        _, status = os.waitpid(pid, 0)
        if conn.fileno() >= 0:
          selector.unregister(conn)
          send(conn, {'status': status})
          conn.close()
      elif children.get(pidfd, (None, None))[1] is key.fileobj:
        # The client was killed, and so is its child. (The `is` test: an event of this batch
        # for a connection whose child exited earlier in it, its pidfd's number since reused.)
        pid, conn = children[pidfd]
        os.kill(pid, signal.SIGKILL)
        selector.unregister(conn)
        conn.close()
  for pid, _ in children.values():
    os.kill(pid, signal.SIGKILL)
  shutil.rmtree(os.path.dirname(path), ignore_errors=True)   # its worker died before it could
  sys.exit(0)


def become(request: dict, started: dict) -> None:
  """This forked child takes the request's streams, directory, environment, ignored signals and
  arguments; the variables the imports set (JAX sets two) are set as in a new interpreter."""
  for target, fd in enumerate(request['fds']):
    os.dup2(fd, target)
    os.close(fd)
  os.chdir(request['cwd'])
  added = {k: v for k, v in os.environ.items() if k not in started}
  os.environ.clear()
  os.environ.update({**added, **request['env']})
  for number in request['ignored']:   # as bash's `&` leaves SIGINT: a new interpreter keeps it so
    signal.signal(number, signal.SIG_IGN)
  import multiprocessing.process
  multiprocessing.process.ORIGINAL_DIR = os.getcwd()   # where a spawned child finds __main__
  import numpy
  numpy.random.seed()   # seeded anew, as in a new interpreter (random's own is, at the fork)


def run(request: dict) -> None:
  """The script or module as `__main__`, with sys.argv, sys.path[0] and __file__ as `python` sets
  them."""
  args = request['args']
  if args[0] == '-m':
    sys.path[0] = os.getcwd()
    sys.argv = [args[1]] + args[2:]   # runpy puts the module's file in argv[0]
    # A module the preloads imported (data.prepare, by train/) is run anew as __main__ beside the
    # imported one, as in a new interpreter, where that import comes later; runpy says so.
    warnings.filterwarnings('ignore', category=RuntimeWarning, module='runpy',
                            message=re.escape(f"'{args[1]}' found in sys.modules"))
    runpy.run_module(args[1], run_name='__main__', alter_sys=True)
  else:
    script = os.path.abspath(args[0])
    sys.path[0] = os.path.dirname(os.path.realpath(script))
    sys.argv = list(args)
    main = types.ModuleType('__main__')
    main.__file__, main.__cached__, main.__builtins__ = script, None, builtins
    sys.modules['__main__'] = main
    with open(script, 'rb') as f:
      code = compile(f.read(), script, 'exec')
    exec(code, main.__dict__)


def command(env: dict) -> list[str]:
  """The words that run a Python command warm in place of `python`, for processes whose
  environment is `env`: its server is started on first use, and the least recently used of more
  than SERVERS is stopped (each is this process's own, ended with it)."""
  key = json.dumps(sorted((k, v) for k, v in env.items() if k not in READ_LATER))
  if key not in _servers:
    _servers[key] = _start(env)
    while len(_servers) > SERVERS:
      _stop(*_servers.pop(next(iter(_servers)))[1:])
  _servers[key] = _servers.pop(key)   # the most recently used last
  return [sys.executable, '-S', CLIENT, _servers[key][0]]


def _start(env: dict) -> tuple[str, subprocess.Popen, str]:
  """A server for `env`'s commands, once it listens: its socket, process and directory."""
  directory = tempfile.mkdtemp(prefix='lmlm-warm-python-')
  path, log_path = os.path.join(directory, 'socket'), os.path.join(directory, 'log')
  with open(log_path, 'w') as log:
    process = subprocess.Popen([sys.executable, '-m', 'tests.warm_python', path], cwd=ROOT,
                               env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
  atexit.register(_stop, process, directory)
  deadline = time.monotonic() + 120
  while not os.path.exists(path):
    if process.poll() is not None or time.monotonic() > deadline:
      with open(log_path) as log:
        raise RuntimeError(f'the warm python did not start: {log.read()[-2000:]}')
    time.sleep(0.05)
  return path, process, directory


def _stop(process: subprocess.Popen, directory: str) -> None:
  if process.poll() is None:
    process.terminate()
    process.wait()
  shutil.rmtree(directory, ignore_errors=True)


_servers: dict[str, tuple] = {}   # an environment's key -> its server (_start's), oldest first


if __name__ == '__main__':
  before = dict(os.environ)
  preload()
  served = serve(sys.argv[1], before)
  become(served, before)
  run(served)
