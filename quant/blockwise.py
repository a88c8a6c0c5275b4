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
  flat = x.reshape(-1).astype(jnp.float32)
  pad = (-flat.size) % block_size
  return jnp.pad(flat, (0, pad)).reshape(-1, block_size)


def quantize_blockwise(x: jax.Array, block_size: int, signed: bool) -> dict:
  """{'codes': uint8 [blocks, block_size], 'scale': float32 [blocks]}."""
  code = jnp.asarray(dynamic_code(signed))
  blocks = _blocks(x, block_size)
  scale = jnp.max(jnp.abs(blocks), axis=1)
  normed = blocks / jnp.where(scale > 0, scale, 1.0)[:, None]
  # Nearest code entry: compare with the midpoints between neighbouring entries.
  midpoints = (code[1:] + code[:-1]) / 2
  codes = jnp.searchsorted(midpoints, normed).astype(jnp.uint8)
  return {'codes': codes, 'scale': scale}


def dequantize_blockwise(q: dict, shape: tuple, signed: bool) -> jax.Array:
  code = jnp.asarray(dynamic_code(signed))
  values = code[q['codes'].astype(jnp.int32)] * q['scale'][:, None]
  size = int(np.prod(shape)) if shape else 1
  return values.reshape(-1)[:size].reshape(shape)
