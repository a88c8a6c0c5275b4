"""NF4 (4-bit NormalFloat) weight storage, as in QLoRA (Dettmers et al. 2023).

A weight tensor is flattened and cut into blocks of `block_size` consecutive values (64 in QLoRA);
blocks run along the flattened tensor in row-major order, so for a kernel [in, out] a block is 64
neighbouring outputs of one input row. Each block is divided by its absolute maximum into [-1, 1]
and every value is stored as the 4-bit index of the nearest of 16 code values, two indices per
byte. Double quantization (also QLoRA's) stores the fp32 block maxima themselves in 8 bits: their
mean is subtracted and the remainders go through quant/blockwise.py's dynamic 8-bit code in blocks
of 256, leaving one fp32 scale per 256 block maxima plus the one fp32 mean.

The code book is built from quantiles of the standard normal, which is what pretrained weights
roughly follow, so each code covers about the same share of the values. Qwix can quantize to NF4
too; this module is the project's own storage format, written to measure and test it directly.
"""
import dataclasses
import functools
import statistics

import jax
import jax.numpy as jnp
import numpy as np

from quant.blockwise import dequantize_blockwise, quantize_blockwise

DEFAULT_BLOCK_SIZE = 64
SCALE_BLOCK_SIZE = 256   # block maxima per fp32 scale under double quantization


@functools.lru_cache(maxsize=None)
def nf4_code() -> np.ndarray:
  """The 16 sorted float32 NF4 values: -1, seven more negatives, 0, eight positives up to 1.

  Quantiles at evenly spaced probabilities from 0.5 up to p_max, 8 on the positive side and 7 on
  the negative (the asymmetry buys an exact zero with 16 entries), each side scaled so its end is
  ±1. p_max cannot be 1 (the quantile is infinite); QLoRA takes the midpoint of 1 - 1/(2*15) and
  1 - 1/(2*16), the outermost bin centres of a 15- and a 16-bin split of [0, 1]."""
  p_max = ((1 - 1 / 30) + (1 - 1 / 32)) / 2
  normal = statistics.NormalDist()
  positive = [normal.inv_cdf(p) for p in np.linspace(p_max, 0.5, 9)[:-1]]
  negative = [-normal.inv_cdf(p) for p in np.linspace(p_max, 0.5, 8)[:-1]]
  values = np.array(sorted(positive + negative + [0.0])) / max(positive)
  assert values.size == 16 and values[0] == -1.0 and values[-1] == 1.0
  return values.astype(np.float32)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=['codes', 'scale', 'scale_scale', 'scale_mean'],
                   meta_fields=['shape', 'dtype', 'block_size'])
@dataclasses.dataclass(frozen=True)
class NF4Tensor:
  """codes: uint8 [blocks, block_size // 2], two code indices a byte (low nibble first).
  scale: fp32 [blocks] block maxima, or under double quantization their uint8 8-bit codes
  [ceil(blocks / 256), 256] with scale_scale fp32 [ceil(blocks / 256)] and scale_mean fp32 []."""
  codes: jax.Array
  scale: jax.Array
  scale_scale: jax.Array | None
  scale_mean: jax.Array | None
  shape: tuple
  dtype: np.dtype
  block_size: int

  @property
  def double_quant(self) -> bool:
    return self.scale_scale is not None


def pack_4bit(indices: jax.Array) -> jax.Array:
  """uint8 [..., 2k] of values 0..15 -> uint8 [..., k]; element 2i in the low nibble of byte i."""
  if indices.shape[-1] % 2:
    raise ValueError(f'pack_4bit: last axis of shape {indices.shape} is odd; allowed: even lengths')
  pairs = indices.astype(jnp.uint8).reshape(*indices.shape[:-1], -1, 2)
  return pairs[..., 0] | (pairs[..., 1] << 4)


def unpack_4bit(packed: jax.Array) -> jax.Array:
  """uint8 [..., k] -> uint8 [..., 2k], the inverse of pack_4bit."""
  pairs = jnp.stack([packed & 0x0F, packed >> 4], axis=-1)
  return pairs.reshape(*packed.shape[:-1], -1)


def nearest_code_index(normed: jax.Array) -> jax.Array:
  """uint8 index of the NF4 value nearest to each value in [-1, 1].

  Counting how many midpoints between neighbouring codes a value exceeds is 15 elementwise
  comparisons that XLA fuses into one pass, with no [n, 16] distance table in memory."""
  code = nf4_code()
  index = jnp.zeros(normed.shape, jnp.uint8)
  for midpoint in (code[:-1] + code[1:]) / 2:
    index = index + (normed > midpoint).astype(jnp.uint8)
  return index


def _check_block_size(shape: tuple, block_size: int):
  size = int(np.prod(shape))
  if not isinstance(block_size, int) or block_size <= 0 or block_size % 2 or size % block_size:
    raise ValueError(
        f'quantize_nf4: tensor of shape {tuple(shape)} ({size} values) with block_size={block_size}; '
        f'allowed: a positive even block_size that divides the element count '
        f'(default {DEFAULT_BLOCK_SIZE})')


def quantize_nf4(w: jax.Array, block_size: int = DEFAULT_BLOCK_SIZE,
                 double_quant: bool = True) -> NF4Tensor:
  """Block-wise NF4 of w; jit with block_size and double_quant static."""
  _check_block_size(w.shape, block_size)
  blocks = w.astype(jnp.float32).reshape(-1, block_size)
  absmax = jnp.max(jnp.abs(blocks), axis=1)
  normed = blocks / jnp.where(absmax > 0, absmax, 1.0)[:, None]
  codes = pack_4bit(nearest_code_index(normed))
  if not double_quant:
    return NF4Tensor(codes, absmax, None, None, tuple(w.shape), jnp.dtype(w.dtype), block_size)
  mean = jnp.mean(absmax)
  q = quantize_blockwise(absmax - mean, SCALE_BLOCK_SIZE, signed=True)
  return NF4Tensor(codes, q['codes'], q['scale'], mean, tuple(w.shape), jnp.dtype(w.dtype),
                   block_size)


def block_absmax(t: NF4Tensor) -> jax.Array:
  """fp32 [blocks]: the per-block scales as dequantization sees them."""
  if not t.double_quant:
    return t.scale
  num_blocks = t.codes.shape[0]
  q = {'codes': t.scale, 'scale': t.scale_scale}
  return dequantize_blockwise(q, (num_blocks,), signed=True) + t.scale_mean


def dequantize_nf4(t: NF4Tensor, dtype=None) -> jax.Array:
  """The tensor back in its original shape, in `dtype` (default: the original dtype)."""
  values = jnp.asarray(nf4_code())[unpack_4bit(t.codes).astype(jnp.int32)]
  w = values * block_absmax(t)[:, None]
  return w.reshape(t.shape).astype(t.dtype if dtype is None else dtype)


def storage_bytes(t: NF4Tensor) -> int:
  """Bytes of every stored array: packed codes, scales and (double quantization) their scales."""
  return sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(t))


def bytes_per_value(t: NF4Tensor) -> float:
  """About 0.5 + 4/64 = 0.5625 bytes/value plain, 0.5 + (1 + 4/256)/64 ≈ 0.516 double-quantized."""
  return storage_bytes(t) / int(np.prod(t.shape))
