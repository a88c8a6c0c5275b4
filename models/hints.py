"""Activation sharding hints by logical axis name.

The model tags activations with logical names; whether and how that maps onto a mesh is decided
by the logical-axis rules that the caller puts in context (flax `logical_axis_rules`). With no rules
in context the hint does nothing, so the model runs unchanged on one device.
"""
import contextlib
import contextvars
import math

import jax
from flax import linen, nnx
from jax.sharding import PartitionSpec


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
  return linen.with_logical_constraint(x, axes)


def mesh_spec(axes: tuple) -> PartitionSpec:
  """The PartitionSpec the rules in context give logical `axes` (all None without rules)."""
  return linen.logical_to_mesh_axes(axes)


def shards(axis: str) -> int:
  """Into how many pieces the rules and the mesh in context split logical `axis` (1: whole)."""
  mesh = jax.sharding.get_abstract_mesh()
  part = mesh_spec((axis,))[0]
  names = (part,) if isinstance(part, str) else tuple(part or ())
  return math.prod(mesh.shape[name] for name in names if name in mesh.shape)


@contextlib.contextmanager
def trace_setting(var: contextvars.ContextVar, value):
  """Trace-time context: `var` holds `value` inside it (the model reads it while it is traced)."""
  token = var.set(value)
  try:
    yield
  finally:
    var.reset(token)


_SPLIT_OVER_DATA = contextvars.ContextVar('weights_split_over_data', default=True)


def weights_split_over_data(split: bool):
  """Trace-time context: whether the layout stores the weights split over the data-parallel
  devices (ZeRO-3), where XLA gathers each where it is used."""
  return trace_setting(_SPLIT_OVER_DATA, split)


def weights_gathered() -> bool:
  """Whether the layout stores the weights split over the data-parallel devices, so that XLA
  gathers each where it is used (`weights_split_over_data`; outside one, taken as split)."""
  return _SPLIT_OVER_DATA.get()


def weights_whole(axes: tuple) -> bool:
  """Whether each device holds a weight of logical `axes` whole as stored: not split over the
  data-parallel devices (`weights_split_over_data`; outside one, taken as split) nor over a
  model-parallel axis by the rules in context."""
  return not weights_gathered() and all(shards(axis) == 1 for axis in axes)


def logical_specs(state):
  """The logical axes of an nnx State's variables, as PartitionSpecs of names. (nnx's own
  `get_partition_spec` maps them through the rules in context: inside a traced step, where the
  layout's activation rules are, it gives mesh names instead.)"""
  with linen.logical_axis_rules(()):
    return nnx.get_partition_spec(state)
