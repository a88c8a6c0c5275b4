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


def enable(directory: str) -> str | None:
  """Points JAX's persistent cache at `directory` (created if needed; `~` expanded); returns the
  directory in use, or None when it is off: `directory` is '' or JAX's own switch
  (JAX_ENABLE_COMPILATION_CACHE=false) is off. Must run before the first compile."""
  if not isinstance(directory, str):
    raise CacheDirError(f'compile_cache={directory!r}; it must be a directory path, {_OR_OFF}')
  if not directory:   # off, whatever JAX_COMPILATION_CACHE_DIR says
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


def serves(config, gpu_target: bool = False) -> bool:
  """Whether the cache can serve this run's programs. Not a GPU target's compiled on a CPU
  (XLA:GPU's executables need a GPU's client to load: JAX warns and compiles again, every time),
  and not a run that keeps state or activations in host memory: on XLA:CPU (jax 0.10.2) such a
  step loaded from the cache aborts the process (`tests/test_offload.py`, with the suite's cache
  on), so it is kept out everywhere."""
  host_memory = (config.parallel.get('offload_optimizer', False)
                 or config.parallel.get('offload_frozen', False)
                 or config.model.get('remat', 'none') in ('offload', 'dots_offload'))
  return not gpu_target and not host_memory


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
    return 'persistent compilation cache off'
  if hit:
    return f'loaded from the persistent compilation cache {path}'
  return f'persistent compilation cache: {path}'
