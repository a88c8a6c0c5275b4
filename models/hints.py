"""Activation sharding hints by logical axis name.

The model tags activations with logical names; whether and how that maps onto a mesh is decided
by the logical-axis rules that the caller puts in context (flax `logical_axis_rules`). With no rules
in context the hint does nothing, so the model runs unchanged on one device.
"""
import jax
from flax import linen


def constrain(x: jax.Array, axes: tuple) -> jax.Array:
  return linen.with_logical_constraint(x, axes)
