"""One writer per workdir: a run holds an exclusive lock on `<workdir>/.lock` while it lives.

The lock is the operating system's (`fcntl.flock` on an open file), so it goes with the process:
a run killed with -9 leaves no stale lock behind. The file keeps the holder's pid, host and start
time, for the message a second run gets. With several processes only process 0 takes it (they all
share the workdir by design).
"""
import contextlib
import datetime
import fcntl
import os
import socket


class WorkdirBusy(RuntimeError):
  pass


@contextlib.contextmanager
def workdir_lock(workdir: str, enabled: bool = True):
  """Hold the lock for the block; raise WorkdirBusy in one line if a live run holds it. A workdir
  this call created is removed again if the block leaves nothing in it but the lock."""
  if not enabled:
    yield
    return
  created = not os.path.exists(workdir)
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, '.lock')
  handle = open(path, 'a+', encoding='utf-8')
  try:
    fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    handle.seek(0)
    holder = handle.read().strip() or 'another process'
    handle.close()
    raise WorkdirBusy(f'--workdir={workdir} is in use by a live run ({holder}); wait for it to end '
                      f'or use another --workdir') from None
  handle.seek(0)
  handle.truncate()
  handle.write(f'pid {os.getpid()} on {socket.gethostname()}, since '
               f'{datetime.datetime.now().isoformat(timespec="seconds")}\n')
  handle.flush()
  try:
    yield
  finally:
    if created and os.listdir(workdir) == ['.lock']:
      os.remove(path)
      os.rmdir(workdir)
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()
