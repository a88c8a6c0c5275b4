"""Joining a multi-process (multi-host) JAX job.

JAX's coordination client aborts the whole process (a C++ check failure, not a Python exception)
when it cannot reach the coordinator, so a process that is not the coordinator first checks that
the address accepts connections, retrying until the timeout, and fails with a plain message.
"""
import os
import socket
import time

import jax


class CoordinatorError(RuntimeError):
  pass


def launched_as_several_tasks() -> bool:
  """True under SLURM or Open MPI with more than one task: JAX then finds the rest itself."""
  for variable in ('SLURM_NTASKS', 'OMPI_COMM_WORLD_SIZE'):
    if int(os.environ.get(variable, '1') or 1) > 1:
      return True
  return False


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  host, _, port = address.rpartition(':')
  if not host or not port.isdigit():
    raise CoordinatorError(f'--coordinator_address={address!r}; give it as host:port, e.g. 10.0.0.1:1234')
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=min(5.0, timeout_s)):
        return
    except OSError as e:
      if time.monotonic() >= deadline:
        raise CoordinatorError(f'could not reach the coordinator at {address} within '
                               f'--coordinator_timeout={timeout_s:g} s ({e.strerror or e}); is process 0 '
                               f'running, and is the port open from this host?') from None
      time.sleep(0.5)


def initialize(coordinator_address: str | None, num_processes: int | None,
               process_id: int | None, timeout_s: int) -> None:
  """Explicit flags, or (all None) what SLURM / Open MPI provide."""
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')   # CPU processes talk over TCP
  if coordinator_address and process_id:
    wait_for_coordinator(coordinator_address, timeout_s)
  jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                             process_id=process_id, initialization_timeout=timeout_s)
