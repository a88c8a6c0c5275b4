"""How long the other process of a two-process run takes to stop once process 0 (the one that
starts the coordination service) is killed with SIGKILL, and how it ends.

  python -m bench.studies.lost_coordinator                 # --peer_timeout 10 s and the default
  python -m bench.studies.lost_coordinator --peer_timeouts=10

Two `main.py` processes of `configs/fsdp.py:tiny` (4 simulated CPU devices each) train on a small
slice of the embedded corpus; process 0 is killed once step 6 is logged (past the checkpoint at
4). Per timeout: the survivor's exit code, seconds from the kill to its exit, its last line, and
whether it printed a traceback or Python's fatal-error dump. Writes
bench/results/lost_coordinator.json.
"""
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from train.metrics import read_rows

_TIMEOUTS = flags.DEFINE_list('peer_timeouts', ['10', 'default'],
                              '--peer_timeout values to try ("default": the flag left out).')
_OUT = flags.DEFINE_string('out', 'bench/results/lost_coordinator.json', 'Where to write.')

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _corpus(folder: str) -> str:
  """A few standard-library modules as the training text (what the tests train on)."""
  import shutil
  import sysconfig
  os.makedirs(os.path.join(folder, 'corpus'))
  stdlib = sysconfig.get_paths()['stdlib']
  for name in ('textwrap.py', 'string.py', 'bisect.py', 'heapq.py', 'queue.py', 'shlex.py'):
    shutil.copy(os.path.join(stdlib, name), os.path.join(folder, 'corpus', name))
  return os.path.join(folder, 'corpus', '*.py')


def _logged_step(workdir: str) -> int:
  rows = read_rows(os.path.join(workdir, 'metrics.jsonl'))
  return max((row['step'] for row in rows if 'loss' in row), default=0)


def lose_process_0(peer_timeout: str) -> dict:
  folder = tempfile.mkdtemp()
  workdir = os.path.join(folder, 'w')
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    port = s.getsockname()[1]
  args = [sys.executable, 'main.py', '--config=configs/fsdp.py:tiny', f'--workdir={workdir}',
          '--config.train.log_every=1', f'--config.data.path={_corpus(folder)}',
          '--config.train.steps=100000', '--config.train.checkpoint_every=4', '--host_devices=4',
          '--num_processes=2', '--coordinator_timeout=60', f'--coordinator_address=127.0.0.1:{port}']
  if peer_timeout != 'default':
    args.append(f'--peer_timeout={peer_timeout}')
  procs = [subprocess.Popen(args + [f'--process_id={i}'], cwd=ROOT, text=True,
                            env={**os.environ, 'XLA_FLAGS': ''}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE) for i in range(2)]
  while _logged_step(workdir) < 6:
    if procs[0].poll() is not None:
      raise RuntimeError(f'process 0 ended first: {procs[0].communicate()[1][-2000:]}')
    time.sleep(0.2)
  procs[0].send_signal(signal.SIGKILL)
  killed = time.monotonic()
  _, err = procs[1].communicate(timeout=900)
  stopped_after = time.monotonic() - killed
  procs[0].communicate()
  return {'peer_timeout_s': peer_timeout, 'survivor_exit_code': procs[1].returncode,
          'survivor_stopped_after_s': round(stopped_after, 2),
          'last_line': err.strip().splitlines()[-1] if err.strip() else '',
          'traceback_or_fatal_dump': 'Traceback' in err or 'Fatal Python error' in err}


def main(argv):
  del argv
  import jax
  results = [lose_process_0(t) for t in _TIMEOUTS.value]
  for r in results:
    print(f'peer_timeout {r["peer_timeout_s"]:>7}: exit {r["survivor_exit_code"]} after '
          f'{r["survivor_stopped_after_s"]:.2f} s')
  with open(os.path.join(ROOT, _OUT.value), 'w') as f:
    json.dump({'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
               'jax': jax.__version__, 'python': platform.python_version(), 'runs': results},
              f, indent=1)


if __name__ == '__main__':
  app.run(main)
