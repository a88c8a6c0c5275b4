"""Lost hosts: every process of a multi-process run watches that the others are alive, and stops
in bounded time, in one line, when one is gone.

Without this, a process whose peer died (killed, out of memory, a node lost) waits inside a
collective that can never complete until JAX's own coordination client notices the missing
heartbeats and aborts the process (SIGABRT, a "Fatal Python error" dump, 100 s by default). Here
each process writes a counter into the coordination service's key-value store every
`timeout / 10` seconds and reads the others'. A peer whose counter has not moved for `timeout`
seconds is lost; so is the coordinator (process 0) when the store stops answering for that long.
The process that finds out prints one line naming the lost process and the newest checkpoint to
stderr and leaves at once with EXIT_LOST_PEER (os._exit: its main thread is stuck in the
collective, and nothing more may be written). JAX's own heartbeat timeout is set well above
`timeout` (parallel/distributed.py) so that this watch always speaks first.

A collective that fails with an error instead of hanging (gloo sees the peer's connection reset)
is held while the watch decides: a lost peer ends the process as above, anything else is raised.
The coordinator (process 0) is watched like any other: with explicit flags the coordination
service runs in a process of its own (parallel/coordinator.py), so the store keeps answering when
process 0 dies. Without them (SLURM / Open MPI, where JAX finds the coordinator itself) the service
lives in process 0, and losing it still aborts every other process (SIGABRT and JAX's dump: jaxlib
cannot hand that error to a Python callback). The workdir is intact either way; the same command
resumes.

A process that ends normally marks itself done first, so that peers still finishing (saving, or
printing the sample) do not take it for lost; one that ends with an error does not, so its peers
stop instead of waiting for it forever.
"""
import os
import sys
import threading
import time

import jax

EXIT_LOST_PEER = 75   # sysexits' EX_TEMPFAIL: a temporary failure; start the job again
BEFORE_EXIT = []      # what must run before a lost peer ends this process (parallel/distributed.py)
_PREFIX = 'peer_watch'


def jax_heartbeat_timeout(timeout_s: float) -> int:
  """JAX's own missing-heartbeat timeout for a watch of `timeout_s`: well after it."""
  return int(2 * timeout_s + 10)


def _exit_lost(me: int, who: str, why: str, checkpoint_dir: str) -> None:
  newest = newest_checkpoint(checkpoint_dir)
  sys.stderr.write(f'\nerror: lost {who} ({why}); process {me} stops without writing anything '
                   f'more (exit code {EXIT_LOST_PEER}); newest checkpoint: {newest}; start every '
                   f'process again with the same command to resume from it\n')
  sys.stderr.flush()
  for leave in BEFORE_EXIT:   # os._exit runs no atexit hooks
    leave()
  os._exit(EXIT_LOST_PEER)


def coordination_client():
  from jax._src import distributed   # the coordination client JAX's own multihost utils use
  return distributed.global_state.client


def newest_checkpoint(checkpoint_dir: str) -> str:
  """'step N in DIR' for the newest committed checkpoint (orbax renames a step's folder to the
  bare step number only once it is complete), or 'none yet'."""
  try:
    steps = [int(name) for name in os.listdir(checkpoint_dir) if name.isdigit()]
  except OSError:
    steps = []
  return f'step {max(steps)} in {checkpoint_dir}' if steps else f'none yet in {checkpoint_dir}'


class PeerWatch:
  """`with PeerWatch(timeout_s, checkpoint_dir):` around the run; `done()` when it ended well."""

  def __init__(self, timeout_s: float, checkpoint_dir: str):
    self.timeout_s = timeout_s
    self.checkpoint_dir = checkpoint_dir
    self.interval_s = max(timeout_s / 10, 0.2)
    self._me = jax.process_index()
    self._peers = [i for i in range(jax.process_count()) if i != self._me]
    self._stop = threading.Event()
    self._threads = []
    self._last_answer = time.monotonic()

  def __enter__(self):
    if not self._peers:   # one process: nothing to watch
      return self
    for target in (self._beat, self._judge):
      thread = threading.Thread(target=target, name=f'peer-watch-{target.__name__}', daemon=True)
      thread.start()
      self._threads.append(thread)
    return self

  def __exit__(self, exc_type, exc, traceback):
    if self._peers and exc_type is not None and issubclass(exc_type, jax.errors.JaxRuntimeError):
      # A collective that failed rather than hung (gloo sees a peer's connection reset): if a
      # peer is gone, the watch finds out within the timeout and ends the process with its line;
      # otherwise this is an error of its own, raised as it is.
      deadline = time.monotonic() + self.timeout_s + 3 * self.interval_s
      while time.monotonic() < deadline:
        time.sleep(self.interval_s)
    self._stop.set()

  def done(self) -> None:
    """This process ended normally: its peers stop watching it."""
    self._stop.set()
    if not self._peers:
      return
    try:
      coordination_client().key_value_set(f'{_PREFIX}/done/{self._me}', '1', allow_overwrite=True)
    except Exception:   # the others are gone already; nothing to tell them
      pass

  def _lost(self, who: str, why: str) -> None:
    if not self._stop.is_set():
      _exit_lost(self._me, who, why, self.checkpoint_dir)

  def _beat(self) -> None:
    client = coordination_client()
    count, now = 0, time.monotonic()
    last_seen = {peer: (None, now) for peer in self._peers}   # peer: (its counter, when it moved)
    while not self._stop.wait(self.interval_s):
      count += 1
      try:
        client.key_value_set(f'{_PREFIX}/beat/{self._me}', str(count), allow_overwrite=True)
        entries = dict(client.key_value_dir_get(f'{_PREFIX}/'))
      except Exception as e:   # the store lives in process 0: it is gone, or going
        if time.monotonic() - self._last_answer > self.timeout_s:
          self._lost('process 0 (the coordinator)', f'its key-value store stopped answering: '
                     f'{_first_line(e)}')
        continue
      now = self._last_answer = time.monotonic()
      for peer in self._peers:
        if _entry(entries, f'done/{peer}') is not None:
          continue
        value = _entry(entries, f'beat/{peer}')
        seen, since = last_seen[peer]
        if value != seen:
          last_seen[peer] = (value, now)
        elif now - since > self.timeout_s:
          self._lost(f'process {peer}', f'no heartbeat for {self.timeout_s:g} s')

  def _judge(self) -> None:
    """A call into the store that hangs (rather than fails) is caught here."""
    while not self._stop.wait(self.interval_s):
      silent = time.monotonic() - self._last_answer
      if silent > self.timeout_s + self.interval_s:
        self._lost('process 0 (the coordinator)', f'its key-value store did not answer for '
                   f'{silent:.0f} s')


def _entry(entries: dict, key: str):
  """A key of key_value_dir_get's answer (some JAX versions return keys with the directory)."""
  return entries.get(f'{_PREFIX}/{key}', entries.get(key))


def _first_line(error) -> str:
  lines = str(error).strip().splitlines()
  return (lines[0] if lines else type(error).__name__)[:300]
