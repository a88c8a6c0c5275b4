"""When to stop or save outside the schedule: SIGTERM / SIGINT (preemption), and wall-clock saves.

A preempted job gets SIGTERM and a grace period. Every process must stop at the *same* step, or
the checkpoint they write together would mix steps. One process: a signal handler sets a flag that
the loop reads after each step. Several processes: JAX's preemption sync point (the coordination
service hears the SIGTERM and picks a step every process reaches, with no per-step traffic);
SIGINT is turned into that same SIGTERM. A second SIGINT interrupts at once.

orbax's `CheckpointManager.reached_preemption` was considered: it is the same JAX sync point, but
it answers False where JAX's preemption service is off (a multi-process run would then be killed by
the SIGTERM without a checkpoint; JAX's own call fails at the loop's first check instead, naming
the setting) and on a Pathways proxy; and with one process (no `jax.distributed` client, so no
service hears a signal) both always answer False, hence the handler here.

`train.checkpoint_minutes` saves by wall clock, for runs whose periodic saves are hours apart.
Clocks differ between processes, so with several the decision is process 0's, broadcast at logged
steps only (where the loop waits for the step anyway).
"""
import os
import signal
import time

import jax


class StopRequests:
  """Install with `with StopRequests(...) as requests:`; ask `stop_now(step)` and `save_now(step)`."""

  def __init__(self, checkpoint_minutes: float, log_every: int):
    self.signal_name: str | None = None
    self._multi = jax.process_count() > 1
    self._interval = checkpoint_minutes * 60
    self._log_every = log_every
    self._last_save = time.monotonic()
    self._previous = {}

  def __enter__(self):
    handled = (signal.SIGINT,) if self._multi else (signal.SIGTERM, signal.SIGINT)
    for sig in handled:
      self._previous[sig] = signal.signal(sig, self._handle)
    return self

  def __exit__(self, *exc):
    for sig, handler in self._previous.items():
      signal.signal(sig, handler)

  def _handle(self, signum, frame):
    if self.signal_name is not None and signum == signal.SIGINT:
      raise KeyboardInterrupt   # a second Ctrl-C: stop without waiting for the save
    self.signal_name = signal.Signals(signum).name
    if self._multi:   # hand it to JAX's notifier, which makes every process agree on a step
      os.kill(os.getpid(), signal.SIGTERM)

  def stop_now(self, step: int) -> bool:
    if not self._multi:
      return self.signal_name is not None
    from jax.experimental import multihost_utils
    if multihost_utils.reached_preemption_sync_point(step):
      self.signal_name = self.signal_name or 'SIGTERM'
      return True
    return False

  def save_now(self, step: int) -> bool:
    """True when `train.checkpoint_minutes` have passed since the last save (or start)."""
    if self._interval <= 0:
      return False
    due = time.monotonic() - self._last_save >= self._interval
    if self._multi:
      if step % self._log_every:
        return False
      from jax.experimental import multihost_utils
      due = bool(multihost_utils.broadcast_one_to_all(due))
    return due

  def saved(self) -> None:
    self._last_save = time.monotonic()
