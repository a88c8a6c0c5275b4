"""fp32 master weights inside the optimizer state, for weights stored in 16 bits (the ZeRO paper's
mixed-precision Adam: 2 bytes of weights, 2 of gradients, 12 of optimizer state per parameter).

`with_master_weights(inner)` wraps any optax transformation: its state holds an fp32 copy of the
weights beside the inner state; each update casts the 16-bit gradients to fp32, runs `inner` on the
copy (so clipping, Adam's moments and weight decay all see fp32), adds its steps to the copy, and
returns the step that takes each stored weight to the copy's rounding. Since the copy lives in the
optimizer state, ZeRO-1/2/3 shard it as they shard the moments; the weights the forward pass
gathers stay 16-bit.

The returned step is master - w in fp32; optax adds it to w in fp32 and rounds the sum to w's
dtype. The fp32 sum is the master exactly whenever the difference is exact, which it is (Sterbenz)
for an old and a new weight within a factor of two of each other; otherwise (a weight crossing
zero, or halving) it is within one fp32 rounding of the master, which changes its bf16 rounding only
at a tie (about once in 2**15 such weights), and the next step starts again from the master. (A bf16
step, bf16(master) - w rounded to bf16, would be off by several bf16 spacings for ~1 % of weights
near zero.) Where the optimizer state is sharded the train step forms the steps on each device's
slice (train/step.py), so the weights are gathered after their rounding, in bf16.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax


class MasterState(NamedTuple):
  master: optax.Params      # the weights in the master dtype
  inner: optax.OptState     # the wrapped optimizer's state (its moments are the master's dtype)


def with_master_weights(inner: optax.GradientTransformation,
                        dtype=jnp.float32) -> optax.GradientTransformation:

  def init_fn(params):
    master = jax.tree.map(lambda p: p.astype(dtype), params)
    return MasterState(master, inner.init(master))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('with_master_weights needs the weights (optax update(..., params))')
    grads = jax.tree.map(lambda g: g.astype(dtype), updates)
    steps, inner_state = inner.update(grads, state.inner, state.master)
    master = optax.apply_updates(state.master, steps)
    to_stored = jax.tree.map(lambda m, p: m - p.astype(m.dtype), master, params)
    return to_stored, MasterState(master, inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


def master_weights(opt_state):
  """The master copy inside an optimizer state built with `with_master_weights` (directly, or
  as one part of an optax.multi_transform), or None."""
  found = []

  def visit(node):
    if isinstance(node, MasterState):
      found.append(node.master)
      return True
    return False

  jax.tree.leaves(opt_state, is_leaf=visit)
  return found[0] if found else None
