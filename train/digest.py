"""A 32-bit digest of every array of a train state, computed where the arrays live.

A checkpoint records the digests of the arrays it was asked to save (train/checkpoint.py), and a
restore recomputes them from what it read: a file whose bytes changed but still decode (a flipped
bit on disk or in transit, a bad copy) is caught, where the storage format's own checks pass it.

Each array's digest is sum_i bits(x_i) * w_i mod 2**32, bits(x) the element's bit pattern as an
unsigned integer and w_i an odd weight drawn from the element's position. Integer addition mod
2**32 is exact, associative and commutative, so the sum is the same on any mesh and in any
reduction order: a checkpoint saved on 8 devices verifies on 1. Any change to one element changes
the digest (an odd weight is invertible mod 2**32, and a bit pattern changes by less than 2**32);
changes to several cancel with probability 2**-32. It reads each array once, on the devices, in
one fused reduction per array: no copy to the host, no gather. An array in host memory (an
offloaded optimizer state) is brought to the devices a slice of its first dimension at a time,
its slices' sums added.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from parallel.padding import fit

_GOLDEN = np.uint32(0x9E3779B1)   # 2**32 / golden ratio: spreads consecutive positions


def _bits(x: jax.Array) -> jax.Array:
  """Each element's bit pattern as uint32 (its value for integers and booleans)."""
  if jnp.issubdtype(x.dtype, jnp.floating):
    width = x.dtype.itemsize * 8
    return jax.lax.bitcast_convert_type(x, jnp.dtype(f'uint{width}')).astype(jnp.uint32)
  if x.dtype == jnp.bool_ or jnp.dtype(x.dtype).itemsize < 4:
    return x.astype(jnp.int32).astype(jnp.uint32)   # small integers (int4/int8) keep their value
  return jax.lax.bitcast_convert_type(x.astype(jnp.int32), jnp.uint32)


def _position_weights(shape: tuple, offset=0) -> jax.Array:
  """An odd uint32 weight per element, from its row-major position (mod 2**32) plus `offset`,
  built from one iota per dimension so that it is laid out like the array (no reshape, so no
  resharding)."""
  position = jnp.full(shape, offset, jnp.uint32)
  stride = 1
  for axis in reversed(range(len(shape))):
    index = jax.lax.broadcasted_iota(jnp.uint32, shape, axis)
    position = position + index * np.uint32(stride % 2**32)
    stride *= shape[axis]
  return position * _GOLDEN | np.uint32(1)


def array_digest(x: jax.Array, offset=0) -> jax.Array:
  """The digest of `x`, its elements' positions counted from `offset`."""
  x = jnp.asarray(x)
  return jnp.sum(_bits(x) * _position_weights(x.shape, offset), dtype=jnp.uint32)


def _stored_digest(x: jax.Array, shape: tuple) -> jax.Array:
  """The digest of stored `x` at its true `shape` (its padding cut off). In host memory, a slice of
  the first dimension at a time is brought to the device (the whole of it might not fit there)."""
  if x.ndim == 0 or jax.typeof(x).memory_space != jax.memory.Space.Host:
    return array_digest(fit(jax.device_put(x, jax.memory.Space.Device), shape))
  per_row = np.uint32(math.prod(shape[1:]) % 2**32)

  def add_row(i, total):
    row = jax.device_put(jax.lax.dynamic_index_in_dim(x, i, 0, keepdims=False),
                         jax.memory.Space.Device)
    return total + array_digest(fit(row, shape[1:]), i.astype(jnp.uint32) * per_row)
  return jax.lax.fori_loop(0, shape[0], add_row, jnp.zeros((), jnp.uint32))


def host_digest(x: np.ndarray, chunk_elements: int = 1 << 26) -> int:
  """The digest of an array in this process's memory, as `array_digest` gives it: brought to a
  local device a run of whole rows (about `chunk_elements` elements) at a time, each run's
  positions counted from its first row's, its digest one fused reduction."""
  if x.ndim == 0:
    return int(array_digest(x))
  per_row = math.prod(x.shape[1:])
  rows = max(1, chunk_elements // max(1, per_row))
  total = 0
  for start in range(0, x.shape[0], rows):
    piece = jax.device_put(x[start:start + rows], jax.local_devices()[0])
    total += int(_fused_digest(piece, np.uint32(start * per_row % 2**32)))
  return total % 2**32


_fused_digest = jax.jit(array_digest)


@functools.partial(jax.jit, static_argnames='shapes')
def digest_arrays(tree, shapes=None):
  """The digests of every array of `tree` as device scalars: dispatched, not waited for (a
  checkpoint save goes on while they are computed; `as_numbers` waits). `shapes`
  (parallel/padding.py:Shapes): the arrays' true shapes where they are stored padded; the digest
  is of the true array, the same on a mesh that pads it otherwise or not at all."""
  leaves, treedef = jax.tree.flatten(tree)
  true = [x.shape for x in leaves] if shapes is None else shapes.leaves
  return treedef.unflatten([_stored_digest(x, shape) for x, shape in zip(leaves, true, strict=True)])


def as_numbers(digests) -> dict[str, int]:
  """{'/'-joined path: digest} from `digest_arrays`' result (waits for it). Every process gets the
  same numbers: each reads its own copy of the replicated scalars."""
  return {jax.tree_util.keystr(path, simple=True, separator='/'): int(np.asarray(
      leaf.addressable_data(0))) for path, leaf in jax.tree_util.tree_flatten_with_path(digests)[0]}


def tree_digests(tree, shapes=None) -> dict[str, int]:
  """{'/'-joined path: digest} of every array of `tree` (global arrays, on any mesh and any number
  of processes; `shapes` as digest_arrays takes them)."""
  return as_numbers(digest_arrays(tree, shapes))


def first_mismatch(saved: dict[str, int], restored: dict[str, int]) -> str | None:
  """The first array (by path) whose digest differs, or that one side lacks; None if all agree."""
  for path in sorted(set(saved) | set(restored)):
    if saved.get(path) != restored.get(path):
      return path
  return None
