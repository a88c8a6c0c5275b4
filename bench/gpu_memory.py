"""How the GPU suite sets the device memory its child processes may use: JAX's allocator reads a
fraction of the device from the environment (XLA_PYTHON_CLIENT_MEM_FRACTION, or the newer
XLA_CLIENT_MEM_FRACTION, never both: jaxlib refuses the pair and the CUDA plugin would not load)
and sizes its pool as that fraction of the device's memory. Pure functions of the environment and
the probed device, tested without a GPU."""
import math

NAMES = ('XLA_CLIENT_MEM_FRACTION', 'XLA_PYTHON_CLIENT_MEM_FRACTION')   # newer first


def fraction_variable(environ) -> str:
  """The fraction variable to write: the one already set, else the long-standing one."""
  return next((name for name in NAMES if name in environ), NAMES[1])


def with_fraction(environ, fraction: str, keep: bool = False) -> dict:
  """A copy of `environ` whose allocator gets `fraction` of the device (`keep`: unless one is set)."""
  env = dict(environ)
  name = fraction_variable(env)
  if not (keep and name in env):
    env[name] = fraction
  return env


def card_environment(environ, device: dict, card_bytes: float) -> tuple[dict, str]:
  """(the environment of a process that may use `card_bytes` of the device and no more, the
  fraction it sets), or ValueError saying why the device cannot stand in for the card. The pool
  is preallocated, and the fraction rounded down, so the process gets at most the card."""
  limit = device.get('bytes_limit')
  if not limit:
    raise ValueError(f'the {device.get("device_kind")} reports no memory limit (its allocator is '
                     f'not the pool a fraction sizes), so it cannot stand in for a '
                     f'{card_bytes / 1e9:.0f} GB card')
  if card_bytes > limit:
    raise ValueError(f'the card ({card_bytes / 1e9:.1f} GB) is larger than the '
                     f'{device.get("device_kind")} ({limit / 1e9:.1f} GB)')
  fraction = f'{math.floor(card_bytes / limit * 1e6) / 1e6:.6f}'
  env = with_fraction(environ, fraction)
  env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'true'
  return env, fraction
