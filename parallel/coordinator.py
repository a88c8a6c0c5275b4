"""The coordination service of a multi-process job, in a process of its own beside process 0.

JAX runs its coordination service (the key-value store, barriers and heartbeats every process
talks to) inside process 0. When process 0 dies, every other process's coordination client sees
the service gone within a second and aborts (SIGABRT and a stack dump); jaxlib cannot hand that
error to a Python callback (std::bad_cast on jax 0.10.2, 0.11.2 and 0.12.0.1). So with explicit
flags process 0 first starts the service here (`python -m parallel.coordinator`, a session of its
own, so that a signal to process 0's group leaves it), and its own JAX binds a stand-in service to a
free local port that nobody joins. The others then find process 0 lost by its missing heartbeats
(parallel/peers.py) and stop as for any other peer: one line, exit code 75.

The service hears how process 0 ended through a pipe: "done" (process 0 left in order: its run
ended, or it stopped with an error, after JAX's shutdown barrier where it reached one) ends it five
seconds later; the pipe closing without it (process 0 died) ends it after `linger_s`, time for
the others to notice and leave. Until then it holds the coordinator's port, and a new process 0
on that port waits for it.
"""
import errno
import os
import socket
import subprocess
import sys
import tempfile
import time


def start(address: str, num_processes: int, heartbeat_timeout_s: int,
          linger_s: float) -> subprocess.Popen:
  """Start the service for `address` (host:port) in its own process (the caller waits until it
  listens, `failed` saying whether it died meanwhile); `address`'s port must be free here."""
  port = address.rpartition(':')[2]
  return subprocess.Popen(
      [sys.executable, '-m', 'parallel.coordinator', f'[::]:{port}', str(num_processes),
       str(heartbeat_timeout_s), str(linger_s)],
      stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=tempfile.TemporaryFile(),
      start_new_session=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def failed(service: subprocess.Popen) -> str | None:
  """Why the service process ended before it served (its last line of stderr), or None."""
  if service.poll() is None:
    return None
  service.stderr.seek(0)
  lines = service.stderr.read().decode(errors='replace').strip().splitlines()
  return lines[-1] if lines else f'exit code {service.returncode}'


def finished(service: subprocess.Popen) -> None:
  """Process 0 is leaving in order (its run ended, well or with an error): the service may go once
  the others have had a moment to leave too. (Only a process 0 that dies leaves it lingering.)"""
  try:
    service.stdin.write(b'done\n')
    service.stdin.close()
  except (OSError, ValueError):   # told already, or it is gone
    pass


def port_is_free(port: int) -> bool:
  """Whether a service could listen on `port` here (one that is closing is no obstacle)."""
  for family, host in ((socket.AF_INET6, '::'), (socket.AF_INET, '0.0.0.0')):
    try:
      with socket.socket(family) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, port))
        return True
    except OSError as e:
      if family == socket.AF_INET6 and e.errno in (errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL):
        continue   # no IPv6 on this host
      return False
  return False


def free_local_address() -> str:
  """A local address nobody listens on: where process 0's own JAX binds its stand-in service."""
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return f'127.0.0.1:{s.getsockname()[1]}'


_GRACE_S = 5.0   # after "done": the others leaving in order still talk to the service meanwhile


def _serve(bind: str, num_processes: int, heartbeat_timeout_s: int, linger_s: float) -> None:
  from jax._src.lib import _jax   # the service JAX's own distributed.initialize starts
  service = _jax.get_distributed_runtime_service(bind, num_processes,
                                                 heartbeat_timeout=heartbeat_timeout_s)
  ended_in_order = sys.stdin.readline().strip() == 'done'
  time.sleep(_GRACE_S if ended_in_order else linger_s)
  del service
  os._exit(0)


if __name__ == '__main__':
  _serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4]))
