"""Shardings for pytrees of annotated parameters, and for batches; divisibility checks."""
import math

import jax
from flax import nnx
from flax.linen import logical_to_mesh_axes
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel.padding import paddable
from parallel.rules import PADDED_AXES, mesh_axes


def shard_ways(mesh: Mesh, part) -> int:
  """How many pieces one PartitionSpec entry cuts a dimension into on `mesh`."""
  return math.prod(mesh.shape[a] for a in mesh_axes(part))


def device_bytes(tree, shardings=None) -> int:
  """Bytes one device holds in its own memory of a tree of arrays (abstract or real), each placed
  by its own sharding or, given `shardings`, by the matching one of those (the largest shard of
  each); what is placed in host memory (memory kind `pinned_host`/`unpinned_host`) is not
  counted."""
  leaves = jax.tree.leaves(tree)
  placed = jax.tree.leaves(shardings) if shardings is not None else [a.sharding for a in leaves]
  return sum(math.prod(sharding.shard_shape(a.shape)) * a.dtype.itemsize
             for a, sharding in zip(leaves, placed, strict=True)
             if sharding.memory_kind not in ('pinned_host', 'unpinned_host'))


def logical_axes(variable) -> tuple:
  """The logical axis names an nnx Variable was annotated with (replicated if none)."""
  names = variable.get_metadata().get('out_sharding') or ()
  return tuple(names) + (None,) * (variable.ndim - len(names))


def logical_axes_tree(abstract_state):
  """Pure-dict tree of logical axis tuples, one per annotated Variable."""
  axes = jax.tree.map(logical_axes, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(axes) if isinstance(axes, nnx.State) else axes


def shardings_for(axes_tree, mesh: Mesh, rules):
  """NamedSharding per leaf of a tree of logical axis tuples."""
  return jax.tree.map(lambda axes: NamedSharding(mesh, logical_to_mesh_axes(axes, rules)),
                      axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def check_divisible(shapes, shardings, axes_tree, what: str) -> None:
  """ValueError naming the first array dimension (and its logical axis) that its mesh axes do
  not divide, where parallel/padding.py cannot pad it (its unpadded axes do not divide it)."""
  flat_shapes = jax.tree_util.tree_flatten_with_path(shapes)[0]
  flat_shardings = jax.tree.leaves(shardings)
  flat_axes = jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))
  for (path, leaf), sharding, logical in zip(flat_shapes, flat_shardings, flat_axes):
    for dim, (size, axes) in enumerate(zip(leaf.shape, sharding.spec)):
      ways = shard_ways(sharding.mesh, axes)
      axes = mesh_axes(axes)
      if size % ways and not paddable(size, axes, sharding.mesh):
        name = jax.tree_util.keystr(path, simple=True, separator='/')
        axes = [a for a in axes if a not in PADDED_AXES]   # those that must divide it
        ways = shard_ways(sharding.mesh, tuple(axes))
        raise ValueError(f'{what} {name} dimension {dim} ({logical[dim]}) of size {size}, which the '
                         f'mesh axes {" x ".join(f"{a}={sharding.mesh.shape[a]}" for a in axes)} = '
                         f'{ways} do not divide; choose a mesh whose {"/".join(axes)} size divides {size}')


def fit_to_shapes(shapes, shardings):
  """The shardings with every mesh axis dropped from a dimension it does not divide (that
  dimension stays whole): for small auxiliary arrays whose sizes the model does not choose."""
  def fit(shape, sharding):
    spec = []
    for size, axes in zip(shape.shape, tuple(sharding.spec) + (None,) * len(shape.shape)):
      spec.append(axes if mesh_axes(axes) and size % shard_ways(sharding.mesh, axes) == 0 else None)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))
  return jax.tree.map(fit, shapes, shardings)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Sharding of a [batch, length] token array: rows split over the data-parallel axes, each row
  whole (under context parallelism the model puts it in zigzag order before splitting it)."""
  return NamedSharding(mesh, logical_to_mesh_axes(('batch', None), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())


def process_feed(mesh: Mesh, rules) -> tuple[int, int]:
  """(index, count): this process feeds block `index` of `count` equal, contiguous blocks of the
  global batch's rows (the blocks its devices hold). Processes whose devices hold the same rows,
  such as the stages of a pipeline (the batch is whole on every stage), feed the same block."""
  sharding = batch_sharding(mesh, rules)
  ways = shard_ways(mesh, sharding.spec[0])
  held = sorted({index[0].start or 0
                 for index in sharding.addressable_devices_indices_map((ways, 1)).values()})
  if held != list(range(held[0], held[0] + len(held))):
    raise ValueError(f'this process\'s devices hold batch blocks {held} of {ways}, which are not '
                     f'contiguous; order the mesh so that each process holds adjacent data-parallel '
                     f'devices')
  return held[0] // len(held), ways // len(held)
