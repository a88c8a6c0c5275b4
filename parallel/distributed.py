"""Joining a multi-process (multi-host) JAX job.

JAX's coordination client aborts the whole process (a C++ check failure, not a Python exception)
when it cannot reach the coordinator, so a process that is not the coordinator first checks that
the address accepts connections, retrying until the timeout, and fails with a plain message.
"""
import atexit
import functools
import os
import socket
import time

import jax

from parallel import coordinator, peers
from parallel.peers import jax_heartbeat_timeout


class CoordinatorError(RuntimeError):
  pass


def launched_as_several_tasks() -> bool:
  """True inside `srun` or `mpirun` with more than one task: JAX then finds the rest itself.
  (SLURM_STEP_NUM_TASKS, not SLURM_NTASKS: the latter is also set in a plain sbatch/salloc shell,
  where there is no job step for JAX to join.)"""
  for variable in ('SLURM_STEP_NUM_TASKS', 'OMPI_COMM_WORLD_SIZE'):
    if int(os.environ.get(variable, '1') or 1) > 1:
      return True
  return False


def wait_for_coordinator(address: str, timeout_s: float, service=None) -> None:
  """Until `address` accepts connections; `service`: process 0's own service process, whose
  failure to start is reported at once."""
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise CoordinatorError(f'--coordinator_address={address!r}; give it as host:port, e.g. 10.0.0.1:1234')
  deadline = time.monotonic() + timeout_s
  while True:
    why = service is not None and coordinator.failed(service)
    if why:
      raise CoordinatorError(f'the coordination service for {address} did not start: {why}')
    try:
      with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise CoordinatorError(f'could not reach the coordinator at {address} within '
                               f'--coordinator_timeout={timeout_s:g} s ({e.strerror or e}); is process 0 '
                               f'running, and is the port open from this host?') from None
      time.sleep(0.5)


def check_flags(coordinator_address: str | None, num_processes: int | None,
                process_id: int | None, timeout_s: int) -> None:
  """CoordinatorError naming the flag, for a combination JAX would reject with a traceback."""
  given = [coordinator_address is not None, num_processes is not None, process_id is not None]
  if any(given) and not all(given):
    raise CoordinatorError('multi-host needs all three of --coordinator_address, --num_processes '
                           'and --process_id (or none of them, under SLURM / Open MPI)')
  if num_processes is not None and not (num_processes >= 1 and 0 <= process_id < num_processes):
    raise CoordinatorError(f'--process_id={process_id} with --num_processes={num_processes}; the '
                           f'process id must be in [0, {num_processes})')
  if timeout_s < 1:
    raise CoordinatorError(f'--coordinator_timeout={timeout_s}; it must be at least 1 second')


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, timeout_s: int, peer_timeout_s: float = 60) -> None:
  """Explicit flags, or (all None) what SLURM / Open MPI provide.

  With explicit flags the coordination service runs in a process of its own that process 0 starts
  (parallel/coordinator.py), else in process 0; if the others never arrive, JAX's client aborts
  process 0 after `timeout_s` with its own message (that abort cannot be caught from Python). A peer lost later is
  found by parallel/peers.py's watch within `peer_timeout_s`; JAX's own heartbeat timeout, whose
  expiry aborts the process, is set well beyond it."""
  check_flags(coordinator_address, num_processes, process_id, timeout_s)
  if not peer_timeout_s >= 1:
    raise CoordinatorError(f'--peer_timeout={peer_timeout_s:g}; it must be at least 1 second')
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')   # CPU processes talk over TCP
  heartbeat_timeout_s = jax_heartbeat_timeout(peer_timeout_s)
  bind = None
  if coordinator_address and process_id == 0 and num_processes > 1:
    # The service in a process of its own (parallel/coordinator.py), so that losing process 0 is
    # a lost peer like any other; this process's JAX binds a stand-in that nobody joins.
    port = int(coordinator_address.rpartition(':')[2])
    deadline = time.monotonic() + heartbeat_timeout_s + 10
    if not coordinator.port_is_free(port):
      print(f'coordinator port {port} is in use: waiting up to {heartbeat_timeout_s + 10} s for '
            f'it (a lost process 0\'s service stays that long for its other processes to leave)',
            flush=True)
      while not coordinator.port_is_free(port):
        if time.monotonic() > deadline:
          raise CoordinatorError(f'--coordinator_address={coordinator_address}: port {port} is '
                                 f'still in use; give another port')
        time.sleep(1.0)
    global _SERVICE
    _SERVICE = coordinator.start(coordinator_address, num_processes, heartbeat_timeout_s,
                                 linger_s=heartbeat_timeout_s)
    leave = functools.partial(coordinator.finished, _SERVICE)   # leaving in order, however
    atexit.register(leave)
    peers.BEFORE_EXIT.append(leave)
    bind = coordinator.free_local_address()
  if coordinator_address and num_processes > 1:
    wait_for_coordinator(coordinator_address, timeout_s, _SERVICE)
  try:
    jax.distributed.initialize(coordinator_address=coordinator_address,
                               num_processes=num_processes, process_id=process_id,
                               initialization_timeout=timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s,
                               coordinator_bind_address=bind)
  except ValueError as e:   # e.g. a cluster JAX cannot read the coordinator from
    raise CoordinatorError(f'could not start multi-host JAX: {e}') from None


_SERVICE = None   # process 0's coordination service process, with explicit flags


def finish() -> None:
  """The run ended well: pass JAX's shutdown barrier with the others, then let the coordination
  service go (parallel/coordinator.py)."""
  if jax.process_count() > 1:
    jax.distributed.shutdown()
  if _SERVICE is not None:
    coordinator.finished(_SERVICE)

