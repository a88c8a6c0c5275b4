"""Shardings for pytrees of annotated parameters, and for batches."""
import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from parallel.rules import to_mesh_spec


def logical_axes(variable) -> tuple:
  """The logical axis names an nnx Variable was annotated with (replicated if none)."""
  names = variable.get_metadata().get('out_sharding') or ()
  return tuple(names) + (None,) * (variable.ndim - len(names))


def param_shardings(abstract_state, mesh: Mesh, rules):
  """NamedSharding per leaf of an nnx State of annotated Variables."""
  def one(variable):
    return NamedSharding(mesh, to_mesh_spec(logical_axes(variable), rules))
  specs = jax.tree.map(one, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))
  return nnx.to_pure_dict(specs) if isinstance(abstract_state, nnx.State) else specs


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
  """Sharding of a [batch, length] token array."""
  return NamedSharding(mesh, to_mesh_spec(('batch', 'length'), rules))


def replicated(mesh: Mesh) -> NamedSharding:
  return NamedSharding(mesh, PartitionSpec())
