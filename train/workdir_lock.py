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
  this call created (or found holding only a lock file) is removed again if the block leaves nothing
  in it but the lock."""
  if not enabled:
    yield
    return
  path = os.path.join(workdir, '.lock')
  handle, created = _acquire(workdir, path)
  handle.seek(0)
  handle.truncate()
  handle.write(f'pid {os.getpid()} on {socket.gethostname()}, since '
               f'{datetime.datetime.now().isoformat(timespec="seconds")}\n')
  handle.flush()
  try:
    yield
  finally:
    # Removed while still held: a run that opened this file meanwhile finds, once it locks it, that
    # the name no longer leads to it, and starts over (_acquire).
    if created and os.listdir(workdir) == ['.lock']:
      os.remove(path)
      with contextlib.suppress(OSError):   # another run has just made it again: it is theirs
        os.rmdir(workdir)
    fcntl.flock(handle, fcntl.LOCK_UN)
    handle.close()


def _acquire(workdir: str, path: str):
  """(the locked file, whether this call created the workdir). A file that its holder removed as it
  left (between our open and our lock) is not the lock any more: then take the one at `path` now."""
  while True:
    try:
      # Ours to remove again if it holds nothing else: made here, or holding only another's lock.
      created = not os.path.exists(workdir) or os.listdir(workdir) == ['.lock']
      os.makedirs(workdir, exist_ok=True)
      handle = open(path, 'a+', encoding='utf-8')
    except (FileNotFoundError, FileExistsError):   # the folder is going with its last holder
      continue
    try:
      fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      handle.seek(0)
      holder = handle.read().strip() or 'another process'
      handle.close()
      raise WorkdirBusy(f'--workdir={workdir} is in use by a live run ({holder}); wait for it to '
                        f'end or use another --workdir') from None
    try:
      if os.path.samestat(os.fstat(handle.fileno()), os.stat(path)):
        return handle, created
    except FileNotFoundError:
      pass
    handle.close()
