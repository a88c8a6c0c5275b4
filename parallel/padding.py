"""Uneven shards: stored arrays padded to a multiple of the mesh axes that split them.

JAX places an array only where its mesh axes divide every dimension they split, so 100m's
d_model of 768 cannot be split over 512 devices as it is. Where a padded axis (the ZeRO axes and
`stage`, parallel/rules.py:PADDED_AXES) does not divide a dimension of a stored array (parameters
under ZeRO-3, optimizer moments from ZeRO-1, a frozen base under ZeRO-3), the array is stored with that
dimension padded at its end to the next multiple: ceil(n / k) values per device, the last devices'
shards partly or wholly padding (as PyTorch FSDP2 pads each parameter's last shard). Only what
crosses a program's edge (the state that is stored, donated, checkpointed) is padded. Inside a
program every array has its true shape again (`Shapes.fit`), and XLA's partitioner lays out an
uneven shard exactly as the padding does (ceil(n / k) per device, padded at the end), so cutting
the padding off at the start of a step and putting zeros back at its end moves no data between
devices. The padding holds zeros: it is never read by the model, so it gets zero gradients, zero
moments and zero updates.

`stage` splits the stored `layers` axis (a pipeline takes each chunk's layers out of it:
parallel/stage_layers.py), so 7 layers on 4 stages are stored as 8, the last a layer of zeros that
no chunk runs; and the vocabulary, where `tensor` divides it: 50,257 rows on 4 stages are stored
as 50,260. `tensor` splits heads and hidden dimensions, not only storage; a dimension it does not
divide is refused (parallel/sharding.py:check_divisible).
"""
import dataclasses
import math

import jax
import jax.numpy as jnp

from parallel.rules import PADDED_AXES, mesh_axes


def padded_shape(shape, sharding) -> tuple[int, ...]:
  """`shape` with every dimension that `sharding`'s padded axes split rounded up to a multiple
  of their size (the other dimensions as they are: check_divisible refuses those)."""
  spec = tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec))
  out = []
  for size, part in zip(shape, spec):
    ways = math.prod(sharding.mesh.shape[a] for a in mesh_axes(part))
    out.append(-(-size // ways) * ways if paddable(size, part, sharding.mesh) else size)
  return tuple(out)


def paddable(size: int, part, mesh) -> bool:
  """Whether a dimension of `size` that PartitionSpec entry `part` splits on `mesh` may be
  padded: where the axes of `part` that are not padded ones (`tensor`) divide it."""
  unpadded = [a for a in mesh_axes(part) if a not in PADDED_AXES]
  return size % math.prod(mesh.shape[a] for a in unpadded) == 0


def padded_abstract(abstract, shardings):
  """ShapeDtypeStructs with the shapes the arrays are stored in under `shardings`, placed there."""
  return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(padded_shape(a.shape, s), a.dtype,
                                                        sharding=s), abstract, shardings)


def fit(x: jax.Array, shape) -> jax.Array:
  """`x` cut or zero-padded at the end of each dimension to `shape`."""
  shape = tuple(shape)
  if x.shape == shape:
    return x
  x = x[tuple(slice(0, min(have, want)) for have, want in zip(x.shape, shape))]
  return jnp.pad(x, [(0, want - have) for have, want in zip(x.shape, shape)])


@dataclasses.dataclass(frozen=True)
class Shapes:
  """The true shape of each leaf of a tree, in flattening order. Hashable, so a jitted function
  can take it as a static argument and give its padded inputs their true shapes (`fit`)."""
  leaves: tuple[tuple[int, ...], ...]

  @classmethod
  def of(cls, tree) -> 'Shapes':
    return cls(tuple(tuple(leaf.shape) for leaf in jax.tree.leaves(tree)))

  def fit(self, tree):
    """Each leaf of `tree` cut or zero-padded to its shape here."""
    leaves, treedef = jax.tree.flatten(tree)
    if len(leaves) != len(self.leaves):
      raise ValueError(f'a tree of {len(leaves)} arrays does not match {len(self.leaves)} shapes')
    return treedef.unflatten([fit(x, shape) for x, shape in zip(leaves, self.leaves)])


def path_name(path) -> str:
  """A leaf's path as checkpoints and digests name it: keys joined by '/'."""
  return jax.tree_util.keystr(path, simple=True, separator='/')


def true_shapes(tree, unpadded: dict | None) -> Shapes:
  """The true shapes of `tree`'s leaves: those `unpadded` names (`unpadded_shapes`), the rest as
  they are."""
  unpadded = unpadded or {}
  return Shapes(tuple(tuple(unpadded.get(path_name(path), leaf.shape))
                      for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]))


def unpadded_shapes(true, stored) -> dict[str, list[int]]:
  """{'/'-joined path: true shape} of each leaf of `stored` (placed ShapeDtypeStructs) that is
  its `true` counterpart padded (what a checkpoint records, so that another mesh can read it back
  at the true shape). A leaf whose shape differs otherwise (8-bit moments blocked from a padded
  weight: their blocks, not their ends, change) is not recorded, so no other mesh cuts it."""
  flat_true = jax.tree_util.tree_flatten_with_path(true)[0]
  return {path_name(path): list(leaf.shape)
          for (path, leaf), kept in zip(flat_true, jax.tree.leaves(stored), strict=True)
          if tuple(leaf.shape) != tuple(kept.shape)
          and padded_shape(leaf.shape, kept.sharding) == tuple(kept.shape)}
