"""JAX's persistent compilation cache: turned on (config key `compile_cache`, a directory; '' = off)
before anything compiles, so that a rerun or a resume of the same config loads its compiled programs
instead of compiling them again; and whether a given compile was served from it."""
import contextlib
import os

import jax

# Compiles shorter than this are not written (one file per eager op would cost more than it saves);
# low enough that the smallest preset's train step (seconds) is kept.
MIN_COMPILE_SECONDS = 0.1
_HIT, _MISS = '/jax/compilation_cache/cache_hits', '/jax/compilation_cache/cache_misses'


class CacheDirError(ValueError):
  """A `compile_cache` that cannot be used as a directory, in one line."""


_OR_OFF = "or --config.compile_cache='' to turn the persistent compilation cache off"


_off_because: str | None = None   # why `enable` kept the cache off, for the compile line


def enable(directory: str, off_because: str | None = None) -> str | None:
  """Points JAX's persistent cache at `directory` (created if needed; `~` expanded); returns the
  directory in use, or None when it is off: `directory` is '', `off_because` says why it cannot
  serve this process (`unserved()`), or JAX's own switch (JAX_ENABLE_COMPILATION_CACHE=false) is
  off. Must run before the first compile."""
  global _off_because
  if not isinstance(directory, str):
    raise CacheDirError(f'compile_cache={directory!r}; it must be a directory path, {_OR_OFF}')
  _off_because = off_because if directory else None
  if not directory or off_because:   # off, whatever JAX_COMPILATION_CACHE_DIR says
    jax.config.update('jax_enable_compilation_cache', False)
    return None
  path = os.path.abspath(os.path.expanduser(directory))
  if os.path.exists(path) and not os.path.isdir(path):
    raise CacheDirError(f'compile_cache={directory!r} is a file, not a directory; give a '
                        f'directory, {_OR_OFF}')
  if not jax.config.jax_enable_compilation_cache:
    return None
  try:
    os.makedirs(path, exist_ok=True)
  except OSError as e:
    raise CacheDirError(f'compile_cache={directory!r} cannot be created ({e.strerror}); give a '
                        f'writable directory, {_OR_OFF}') from None
  if not os.access(path, os.W_OK | os.X_OK):
    raise CacheDirError(f'compile_cache={directory!r} is not writable; give a writable directory, '
                        f'{_OR_OFF}')
  jax.config.update('jax_compilation_cache_dir', path)
  jax.config.update('jax_persistent_cache_min_compile_time_secs', MIN_COMPILE_SECONDS)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', -1)   # any size
  return path


def unserved(gpu_target: bool = False) -> str | None:
  """Why the cache cannot serve this process's programs, or None where it can; called once the
  backend's devices are set. Not a GPU target's programs compiled on a CPU (XLA:GPU's executables
  need a GPU's client to load: JAX warns and compiles again, every time). Not XLA:CPU's over more
  than one device: a program loaded from the cache runs its collectives in whatever order each
  device's thunks become ready, not the compiled order (the deserialised collectives no longer
  share the resource that orders them), so one device can wait in an all-gather while the others
  wait in an all-reduce until XLA aborts the process (seen with jaxlib 0.10.2 on plain steps, and
  with 0.11.2 and 0.12.0.1 on steps with state in host memory; a freshly compiled program keeps
  the order)."""
  if gpu_target:
    return 'a GPU target compiled on the CPU'
  devices = jax.devices()
  if devices[0].platform == 'cpu' and len(devices) > 1:
    return f'XLA:CPU over {len(devices)} devices'
  return None


def cache_dir() -> str | None:
  """The cache directory compiles use now, or None when the cache is off."""
  path = jax.config.jax_compilation_cache_dir
  return path if path and jax.config.jax_enable_compilation_cache else None


class Watch:
  """Whether the last compile inside `watch()` was a hit (True), a miss (False), or did not consult
  the cache (None: it is off)."""
  hit: bool | None = None

  def __call__(self, event: str, **_) -> None:
    if event in (_HIT, _MISS):
      self.hit = event == _HIT


@contextlib.contextmanager
def watch():
  seen = Watch()
  jax.monitoring.register_event_listener(seen)
  try:
    yield seen
  finally:
    jax.monitoring.unregister_event_listener(seen)


def describe(hit: bool | None) -> str:
  """The compile line's note on the cache, e.g. 'loaded from the persistent cache <dir>'."""
  path = cache_dir()
  if path is None:
    return 'persistent compilation cache off' + (f' for {_off_because}' if _off_because else '')
  if hit:
    return f'loaded from the persistent compilation cache {path}'
  return f'persistent compilation cache: {path}'
