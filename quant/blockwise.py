"""Block-wise dynamic 8-bit quantization, the storage format of 8-bit optimizer states.

A tensor is flattened, padded to a whole number of blocks, and each block is scaled by its own
absolute maximum into [-1, 1]; every value is then stored as the index (one byte) of the nearest
entry of a 256-value code book. The code book is *dynamic* (after Dettmers et al., "8-bit
Optimizers via Block-wise Quantization"): its entries are spread over seven decades, with more of
them in the larger decades, so that both the small and the large values of Adam's moments keep
a few significant digits. Per-block scales confine an outlier's damage to its own block.

The code books below are this project's own construction of that idea: decade d (values near
10^(d-6)) gets 2^d entries for a signed code (2^(d+1) unsigned), placed at the midpoints of an even
split of [0.1, 1) x 10^(d-6), plus 0 and 1.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np

DECADES = 7
# Where the code books below hold 0: after the 127 negative entries (signed), or first.
ZERO_INDEX = {True: 127, False: 0}


@functools.lru_cache(maxsize=None)
def dynamic_code(signed: bool) -> np.ndarray:
  """256 sorted float32 values in [-1, 1] (signed) or [0, 1] (unsigned)."""
  magnitudes = []
  for decade in range(DECADES):
    count = 2 ** decade if signed else 2 ** (decade + 1)
    edges = np.linspace(0.1, 1.0, count + 1)
    magnitudes.extend(10.0 ** (decade - DECADES + 1) * (edges[:-1] + edges[1:]) / 2)
  magnitudes = np.asarray(magnitudes)
  values = np.concatenate([-magnitudes, [0.0], magnitudes, [1.0]]) if signed else \
      np.concatenate([[0.0], magnitudes, [1.0]])
  assert values.size == 256, values.size
  return np.sort(values).astype(np.float32)


def _blocks(x: jax.Array, block_size: int) -> jax.Array:
  flat = x.reshape(-1)
  pad = (-flat.size) % block_size
  return jnp.pad(flat, (0, pad)).reshape(-1, block_size)


def _code_index(normed: jax.Array, signed: bool) -> jax.Array:
  """Index of the code entry nearest to each value in [-1, 1], computed arithmetically.

  Each decade's entries are the centres of equal bins that tile it: a log10 finds the decade, a
  division the bin. Just above a decade boundary the next lower entry (a narrower bin's centre)
  can be nearer than the bin's own, so the two are compared. This is elementwise (XLA fuses it
  into one pass); a search over the 256 entries (jnp.searchsorted) needs some 24 bytes of
  temporaries per value, more than the fp32 state it replaces."""
  magnitude = jnp.abs(normed)
  decade = jnp.clip(jnp.floor(jnp.log10(jnp.maximum(magnitude, 1e-30))) + DECADES, 0, DECADES - 1)
  count = jnp.exp2(decade + (0 if signed else 1))
  start = 10.0 ** (decade - DECADES)
  width = 0.9 * 10.0 ** (decade - DECADES + 1) / count
  within = jnp.clip(jnp.floor((magnitude - start) / width), 0, count - 1)
  rank = ((count - (1 if signed else 2)) + within).astype(jnp.int32)  # smaller decades first
  code = dynamic_code(signed)
  smallest, largest = float(code[code > 0][0]), float(code[-2])
  zero_index, one_index = ZERO_INDEX[signed], 255
  magnitude_index = (128 + rank) if signed else (1 + rank)
  index = jnp.where(magnitude < smallest / 2, zero_index,
                    jnp.where(magnitude > (largest + 1) / 2, one_index, magnitude_index))
  table = jnp.asarray(code)
  lower = jnp.maximum(index - 1, zero_index)
  index = jnp.where(jnp.abs(table[lower] - magnitude) < jnp.abs(table[index] - magnitude), lower, index)
  if signed:   # negatives mirror the positives below the zero entry (there is no -1 entry)
    index = jnp.where((normed < 0) & (index != zero_index), 254 - jnp.minimum(index, 254), index)
  return index.astype(jnp.uint8)


def to_blocks(x: jax.Array, block_size: int) -> jax.Array:
  """[...] -> [blocks, block_size] in x's dtype, zero-padded at the end."""
  return _blocks(x, block_size)


def from_blocks(blocks: jax.Array, shape: tuple) -> jax.Array:
  size = int(np.prod(shape)) if shape else 1
  return blocks.reshape(-1)[:size].reshape(shape)


def quantize_blocks(blocks: jax.Array, signed: bool) -> dict:
  """[blocks, block_size] -> {'codes': uint8 [blocks, block_size], 'scale': fp32 [blocks]}."""
  blocks = blocks.astype(jnp.float32)
  scale = jnp.max(jnp.abs(blocks), axis=1)
  normed = blocks / jnp.where(scale > 0, scale, 1.0)[:, None]
  return {'codes': _code_index(normed, signed), 'scale': scale}


def zero_blocks(shape: tuple, block_size: int, signed: bool) -> dict:
  """`quantize_blockwise` of zeros of `shape`, written out: every code the zero entry's, every
  scale 0. Quantizing a zero constant instead would have XLA:GPU fold the whole quantization at
  compile time (seconds for a few million values, in the state's creation)."""
  size = int(np.prod(shape)) if shape else 1
  blocks = -(-size // block_size)
  return {'codes': jnp.full((blocks, block_size), ZERO_INDEX[signed], jnp.uint8),
          'scale': jnp.zeros((blocks,), jnp.float32)}


def dequantize_blocks(q: dict, signed: bool) -> jax.Array:
  code = jnp.asarray(dynamic_code(signed))
  return code[q['codes'].astype(jnp.int32)] * q['scale'][:, None]


def quantize_blockwise(x: jax.Array, block_size: int, signed: bool) -> dict:
  """{'codes': uint8 [blocks, block_size], 'scale': float32 [blocks]}."""
  return quantize_blocks(to_blocks(x, block_size), signed)


def dequantize_blockwise(q: dict, shape: tuple, signed: bool) -> jax.Array:
  return from_blocks(dequantize_blocks(q, signed), shape)
