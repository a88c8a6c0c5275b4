"""The coordination service of a multi-process job, in a process of its own beside process 0.

JAX runs its coordination service (the key-value store, barriers and heartbeats every process
talks to) inside process 0. When process 0 dies, every other process's coordination client sees
the service gone within a second and aborts (SIGABRT and a stack dump); jaxlib cannot hand that
error to a Python callback (std::bad_cast on jax 0.10.2, 0.11.2 and 0.12.0.1). So with explicit
flags process 0 first starts the service here (`python -m parallel.coordinator`, a session of its
own, so that a signal to process 0's group leaves it), and its own JAX binds a stand-in service to a
free local port that nobody joins. The others then find process 0 lost by its missing heartbeats
(parallel/peers.py) and stop as for any other peer: one line, exit code 75.

The service hears how process 0 ended through a pipe: "done" (process 0 passed JAX's shutdown
barrier, so every process has finished) ends it at once; the pipe closing without it (process 0
died, or left with an error) ends it after `linger_s`, time for the others to notice and leave.
Until then it holds the coordinator's port.
"""
import os
import socket
import subprocess
import sys
import time


def start(address: str, num_processes: int, heartbeat_timeout_s: int,
          linger_s: float) -> subprocess.Popen:
  """Start the service for `address` (host:port) in its own process (the caller waits until it
  listens); `address`'s port must be free here."""
  port = address.rpartition(':')[2]
  return subprocess.Popen(
      [sys.executable, '-m', 'parallel.coordinator', f'[::]:{port}', str(num_processes),
       str(heartbeat_timeout_s), str(linger_s)],
      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
      start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def finished(service: subprocess.Popen) -> None:
  """Process 0 passed JAX's shutdown barrier: the service may go."""
  try:
    service.stdin.write(b'done\n')
    service.stdin.close()
  except OSError:   # it is gone already
    pass


def port_is_free(port: int) -> bool:
  with socket.socket(socket.AF_INET6) as s:
    try:
      s.bind(('::', port))
      return True
    except OSError:
      return False


def free_local_address() -> str:
  """A local address nobody listens on: where process 0's own JAX binds its stand-in service."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return f'127.0.0.1:{s.getsockname()[1]}'


def _serve(bind: str, num_processes: int, heartbeat_timeout_s: int, linger_s: float) -> None:
  from jax._src.lib import _jax   # the service JAX's own distributed.initialize starts
  service = _jax.get_distributed_runtime_service(bind, num_processes,
                                                 heartbeat_timeout=heartbeat_timeout_s)
  ended_well = sys.stdin.readline().strip() == 'done'
  time.sleep(1.0 if ended_well else linger_s)
  del service
  os._exit(0)


if __name__ == '__main__':
  _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
