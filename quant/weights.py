"""Weight-only quantized storage of the dense kernels (post-training quantization, and loading a
checkpoint quantized: what `load_in_8bit` / `load_in_4bit` do in transformers).

A quantized kernel replaces the float `nnx.Param` of a `Dense` with a `QuantizedKernel` whose
arrays are `QuantizedWeight` variables: not parameters, so they get neither gradients nor optimizer
state, and what is stored (and what the compiled step takes as arguments) is the quantized bytes.
The matmul dequantizes one layer's kernel to the compute dtype when it runs; inside the scanned
stack that is one layer at a time.

Formats (per layer of a stacked kernel, seen as a matrix [inputs, outputs]):
  int8  one absmax scale per output channel; 1 byte per weight
  int4  one absmax scale per group of 64 inputs of each output channel (fewer where 64 does not
        divide the inputs); codes packed two per byte, because XLA:CPU stores jnp.int4 in a byte.
        A kernel trained with learned step sizes (LSQ) is stored on its own grid instead: every
        group of a channel takes that channel's step size, so the codes are LSQ's levels and
        dequantizing gives back exactly the weights the run multiplied by
  nf4   QLoRA's NormalFloat-4: blocks of 64 consecutive values, double-quantized scales
"""
import math

import jax
import jax.numpy as jnp
from flax import nnx

from quant.nf4 import NF4Tensor, dequantize_nf4, pack_4bit, quantize_nf4, unpack_4bit

WEIGHT_FORMATS = ('int8', 'int4', 'nf4')
GROUP = 64


class QuantizedWeight(nnx.Variable):
  """Quantized storage: frozen (not an nnx.Param)."""


def _matrix_shape(shape, n_in):
  return math.prod(shape[:n_in]), math.prod(shape[n_in:])


def _quantize_int8(w, n_in, steps=None):
  w = w.astype(jnp.float32)
  scale = jnp.max(jnp.abs(w), axis=tuple(range(n_in))) / 127          # one per output channel
  codes = jnp.round(w / jnp.where(scale > 0, scale, 1.0)).astype(jnp.int8)
  return {'codes': codes, 'scale': scale}


def _dequantize_int8(parts, shape, n_in):
  return parts['codes'].astype(jnp.float32) * parts['scale']


def _int4_group(inputs: int) -> int:
  return math.gcd(inputs, GROUP)


def _quantize_int4(w, n_in, steps=None):
  """`steps`: LSQ's step sizes [*out], the grid to store on (None: absmax per group)."""
  inputs, outputs = _matrix_shape(w.shape, n_in)
  group = _int4_group(inputs)
  m = w.astype(jnp.float32).reshape(inputs // group, group, outputs)
  if steps is None:
    scale = jnp.max(jnp.abs(m), axis=1) / 7                              # [groups, outputs]
  else:
    scale = jnp.broadcast_to(steps.astype(jnp.float32).reshape(outputs), (inputs // group, outputs))
  # (a learned step may have trained through zero to a negative value: its grid is still codes * s)
  codes = jnp.clip(jnp.round(m / jnp.where(scale != 0, scale, 1.0)[:, None]), -8, 7)
  return {'codes': pack_4bit((codes + 8).astype(jnp.uint8).reshape(-1)), 'scale': scale}


def _dequantize_int4(parts, shape, n_in):
  inputs, outputs = _matrix_shape(shape, n_in)
  group = _int4_group(inputs)
  codes = unpack_4bit(parts['codes']).astype(jnp.float32) - 8
  return (codes.reshape(inputs // group, group, outputs) * parts['scale'][:, None]).reshape(
      inputs, outputs)


def _quantize_nf4(w, n_in, steps=None):
  t = quantize_nf4(w)
  return {'codes': t.codes, 'scale': t.scale, 'scale_scale': t.scale_scale,
          'scale_mean': t.scale_mean}


def _dequantize_nf4(parts, shape, n_in):
  return dequantize_nf4(NF4Tensor(**parts, shape=tuple(shape), dtype=jnp.dtype(jnp.float32),
                                  block_size=64))


def _int8_axes(axes, n_in):
  return {'codes': axes, 'scale': axes[n_in:]}


def _int4_axes(axes, n_in):
  # The packed codes are one flat run per layer: they shard where the kernel's `embed` would
  # (over fsdp under ZeRO-3), and are replicated over `tensor`.
  return {'codes': ('embed',), 'scale': ('embed', None)}


def _nf4_axes(axes, n_in):
  return {'codes': ('embed', None), 'scale': ('embed', None), 'scale_scale': ('embed',),
          'scale_mean': ()}


# format: (quantize, dequantize, logical axes of each stored part from the kernel's axes)
_FORMATS = {'int8': (_quantize_int8, _dequantize_int8, _int8_axes),
            'int4': (_quantize_int4, _dequantize_int4, _int4_axes),
            'nf4': (_quantize_nf4, _dequantize_nf4, _nf4_axes)}


def check_format(fmt: str) -> None:
  if fmt not in _FORMATS:
    raise ValueError(f'weight format {fmt!r}; allowed: {", ".join(WEIGHT_FORMATS)}')


def quantize_parts(kernel: jax.Array, fmt: str, n_in: int, stacked: bool,
                   steps: jax.Array | None = None) -> dict:
  """The stored parts of `kernel` in `fmt` (one set per layer when `stacked`). `steps`: int4
  only, LSQ's learned step sizes [*out] (per layer when stacked) as the grid; other formats
  ignore them (the kernel given is then already on that grid)."""
  quantize = _FORMATS[fmt][0]
  one = lambda w, s: quantize(w, n_in, s)
  return (jax.vmap(one) if stacked else one)(kernel, steps)


class QuantizedKernel(nnx.Module):
  """A kernel [*in, *out] (with a leading `layers` axis when `stacked`) stored in `fmt`.
  `axes`: the float kernel's logical axes as stored (with `layers` when stacked); each stored part
  carries the axes it shards by (a part a mesh axis does not divide stays whole: train/state.py)."""

  def __init__(self, kernel: jax.Array, fmt: str, n_in: int, stacked: bool,
               axes: tuple | None = None, steps: jax.Array | None = None):
    check_format(fmt)
    self.fmt, self.n_in, self.stacked = fmt, n_in, stacked
    self.shape = tuple(kernel.shape[1:] if stacked else kernel.shape)   # one layer's shape
    self.axes = tuple(axes) if axes is not None else (None,) * kernel.ndim
    layer_axes = self.axes[1:] if stacked else self.axes
    part_axes = _FORMATS[fmt][2](layer_axes, n_in)
    parts = quantize_parts(kernel, fmt, n_in, stacked, steps)
    self.part_names = tuple(parts)
    for name, value in parts.items():
      names = (('layers',) if stacked else ()) + tuple(part_axes[name])
      setattr(self, name, QuantizedWeight(value, out_sharding=names, eager_sharding=False))

  def dequantize(self, dtype) -> jax.Array:
    """One layer's kernel (inside the scan the stacked axis is already sliced off) in `dtype`."""
    parts = {name: getattr(self, name)[...] for name in self.part_names}
    return _FORMATS[self.fmt][1](parts, self.shape, self.n_in).reshape(self.shape).astype(dtype)

  def dequantize_all(self, dtype) -> jax.Array:
    """The whole kernel, every layer of a stacked one, in `dtype` (outside the scan)."""
    parts = {name: getattr(self, name)[...] for name in self.part_names}
    one = lambda p: _FORMATS[self.fmt][1](p, self.shape, self.n_in).reshape(self.shape)
    return (jax.vmap(one)(parts) if self.stacked else one(parts)).astype(dtype)
