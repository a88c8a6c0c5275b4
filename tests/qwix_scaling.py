"""Symmetric absmax scaling at each granularity, and the error each format promises: what the
tests hold Qwix's quantization to (test support, not used by the project itself).

Granularity says which values share one scale. For a matrix [rows, columns] (a weight is
[inputs, outputs], an activation [tokens, features]):
  tensor   one scale for everything
  channel  one per column (a weight's output channel)
  token    one per row (an activation's token)
  block    one per `block_size` consecutive rows of each column (a weight's inputs, in tiles)
The quantization itself is Qwix's (`qwix.quantize`); this module names the granularities the way
the rest of the project does and states the error bound that tests hold it to.
"""
import jax
import jax.numpy as jnp
import qwix

GRANULARITIES = ('tensor', 'channel', 'token', 'block')
QTYPES = {'int8': jnp.int8, 'int4': jnp.int4, 'fp8_e4m3': jnp.float8_e4m3fn,
          'fp8_e5m2': jnp.float8_e5m2}


def quantize(x: jax.Array, fmt: str, granularity: str, block_size: int = 0) -> qwix.QArray:
  if fmt not in QTYPES:
    raise ValueError(f'format {fmt!r}; allowed: {", ".join(QTYPES)}')
  if granularity not in GRANULARITIES:
    raise ValueError(f'granularity {granularity!r}; allowed: {", ".join(GRANULARITIES)}')
  if x.ndim != 2:
    raise ValueError(f'expected a matrix [rows, columns], got shape {x.shape}')
  axes = {'tensor': dict(), 'channel': dict(channelwise_axes=(1,)),
          'token': dict(channelwise_axes=(0,)), 'block': dict(channelwise_axes=(1,))}[granularity]
  if granularity == 'block':
    if block_size < 1 or x.shape[0] % block_size:
      raise ValueError(f'block_size={block_size} does not divide the {x.shape[0]} rows; allowed: '
                       f'a positive divisor of {x.shape[0]}')
    axes['tiled_axes'] = {0: block_size}
  return qwix.quantize(x, QTYPES[fmt], **axes)


def dequantize(q: qwix.QArray) -> jax.Array:
  return qwix.dequantize(q)


def error_bound(x: jax.Array, q: qwix.QArray, fmt: str) -> jax.Array:
  """The largest |x - dequantize(q)| the format allows, elementwise.

  Integers round to the nearest step: half a scale. Floats round to the nearest representable value:
  a relative 2^-(fraction bits + 1) of |x| for normal values, and half the smallest subnormal step
  (times the scale) below the normal range."""
  scale = jnp.broadcast_to(_expand_scale(q.scale, x.shape), x.shape).astype(jnp.float32)
  dtype = QTYPES[fmt]
  if jnp.issubdtype(dtype, jnp.integer):
    return scale / 2
  info = jnp.finfo(dtype)
  subnormal_step = float(info.smallest_subnormal)
  return jnp.maximum(jnp.abs(x) * 2.0 ** -(info.nmant + 1), scale * subnormal_step / 2)


def _expand_scale(scale: jax.Array, shape: tuple[int, ...]) -> jax.Array:
  """A tiled scale [tiles, columns] repeated back over the rows of each tile."""
  reps = [n // s for n, s in zip(shape, scale.shape)]
  return jnp.repeat(scale, reps[0], axis=0) if reps[0] > 1 else scale
