"""The optimizer's update with its state in host memory (`parallel.offload_optimizer`).

The fp32 master copy and Adam's moments live in pinned host memory (train/state.py places them
there); the device holds the weights and gradients. The update runs in two parts: first the
weights that are not stacked (embedding, head, final norm) in one piece, their state brought over
whole; then the weights stacked on a `layers` axis (nearly all of the bytes) in a scan over the
layers, whose input is each layer's state sliced from host memory and brought to the device, and
whose output is the layer's new state sent back to host memory (stacked there by the scan: the
patterns XLA's GPU host offloader streams, parameter streaming and activation offloading); the
layer's new weights are written into their own (donated) buffer. So the device holds one layer's
optimizer state at a time (a 7B model's 12 bytes per parameter of state: 2.4 GB of its 81 GB), as
ZeRO-Offload keeps Adam's state off the GPU; host memory holds the old and the new state during
the update.

With `parallel.offload_update='host'` the update is instead one computation by the host's
processor over the whole state where it lives (`_host_update`, jax's `compute_on`): the weights
and gradients go to host memory and the new weights come back, and nothing of the state crosses.

Each part sees only its own gradients, so clipping takes the step's global norm
(optim/adamw.py:clip_by_global_norm, from `tx_for_norm`); Adam and weight decay are elementwise, so
the parts' updates are the whole update's, but for that norm's summation order. Both parts advance
the step counts (Adam's bias correction, the schedule) from the same values: the new counts are
the first part's.

XLA:CPU keeps host and device memory in the same RAM and jax lowers a placement inside a program
only for GPU and TPU, so on CPU the transfers are no-ops and this is the same arithmetic as the
update without offload; the state's placement at the program's edge is kept (the compiled
program's parameter layouts say which arguments live in host memory: memory/compiled.py).
"""
import dataclasses
from typing import Callable

import jax
import optax
from jax.sharding import NamedSharding, PartitionSpec

from parallel.padding import fit

STACKED, REST, SHARED = 'stacked', 'rest', 'shared'   # a leaf's part (SHARED: the counts)
_masked = lambda x: isinstance(x, optax.MaskedNode)


def to_device(tree):
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device), tree)


def to_host(tree):
  return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Host), tree)


def _leaves(tree):
  return jax.tree.flatten(tree, is_leaf=_masked)


def _part(tree, parts, part: str, shared: bool = True):
  """`tree` with the leaves of other parts masked (optax.MaskedNode: the optimizer skips them),
  and the shared ones (the counts) too unless `shared`."""
  leaves, treedef = _leaves(tree)
  kept = (part, SHARED) if shared else (part,)
  return treedef.unflatten([x if p in kept or _masked(x) else optax.MaskedNode()
                            for x, p in zip(leaves, _leaves(parts)[0], strict=True)])


def _join(stacked, rest, parts):
  """One tree from the two parts' results (the shared leaves from `rest`)."""
  treedef = _leaves(parts)[1]
  return treedef.unflatten([s if p == STACKED else r for s, r, p in zip(
      _leaves(stacked)[0], _leaves(rest)[0], _leaves(parts)[0], strict=True)])


@dataclasses.dataclass(frozen=True)
class OffloadedOptimizer:
  """`tx_for_norm(norm)`: the run's optimizer, clipping by a given global norm; `stacked`: a tree
  like the parameters, True for each weight stacked on a `layers` axis that no device splits
  (streamed a layer at a time); `layer_shardings`: their paths -> the sharding one layer is stored
  in (the new layer's values are placed there); `update_shardings`, `update_shapes`: path ->
  where and in which (padded) shape the optimizer's state holds each parameter's values;
  `on_host`: the update computed by the host's processor where the state lives
  (`parallel.offload_update='host'`), not streamed through the device."""
  tx_for_norm: Callable
  stacked: dict
  layer_shardings: dict
  update_shardings: dict
  update_shapes: dict
  on_host: bool = False

  def update(self, grads, opt_state, params, norm, finite):
    """(new parameters, new optimizer state) after one update. `grads`, `params`: as stored;
    `norm`: the gradients' global norm; `finite`: whether to update at all (False: every value is
    written back as it was)."""
    if self.on_host:
      return _host_update(self, grads, opt_state, params, norm, finite)
    return _streamed_update(self, self.tx_for_norm(norm), grads, opt_state, params, finite)

  def for_optimizer(self, path, x, layer=None):
    """`x`, a parameter's values (its `layer`th layer where given), in the optimizer's shape and
    placement."""
    key = jax.tree_util.keystr(path)
    sharding, shape = self.update_shardings[key], self.update_shapes[key]
    if layer is not None:
      x, shape = x[layer], shape[1:]
      sharding = NamedSharding(sharding.mesh, PartitionSpec(*tuple(sharding.spec)[1:]))
    return jax.lax.with_sharding_constraint(fit(x, shape), sharding)


def _parts(plan: OffloadedOptimizer, tx, opt_state):
  """(a tree like the parameters, a tree like `opt_state`): each leaf's part, STACKED or REST (and
  SHARED for the optimizer's counts)."""
  param_parts = jax.tree.map(lambda s: STACKED if s else REST, plan.stacked)
  return param_parts, optax.tree_map_params(tx, lambda _, part: part, opt_state, param_parts,
                                            transform_non_params=lambda _: SHARED,
                                            is_leaf=_masked)


def written_anew(plan: OffloadedOptimizer, tx, opt_state):
  """A tree like `opt_state`, True where the update writes a leaf's new value into a buffer of
  its own (streamed: the layer stacks, a layer at a time; on the host: every leaf, the host
  computation's results; train/donation.py says why the step must not donate them)."""
  return jax.tree.map(lambda part: plan.on_host or part == STACKED, _parts(plan, tx, opt_state)[1])


def _streamed_update(plan: OffloadedOptimizer, tx, grads, opt_state, params, finite):
  # The non-finite skip is a choice between new and old values as each is written, not a
  # lax.cond around the update: XLA copies a loop's carry that a conditional's operand feeds (at
  # 100m ZeRO-2 on 8 devices, the whole stacked optimizer state: +0.09 GiB per device).
  keep = lambda new, old: new if _masked(new) else jax.numpy.where(finite, new, old)
  param_parts, state_parts = _parts(plan, tx, opt_state)

  def select(tree, part, layer=None):
    """The parameter-shaped `tree`'s leaves of `part`, as the optimizer takes them."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x, p: plan.for_optimizer(path, x, layer) if p == part else optax.MaskedNode(),
        tree, param_parts)

  # The weights that are not stacked: one update, their state brought over whole.
  rest_old = to_device(_part(opt_state, state_parts, REST))
  rest_updates, rest_state = tx.update(select(grads, REST), rest_old, select(params, REST))
  rest_state = to_host(jax.tree.map(keep, rest_state, rest_old, is_leaf=_masked))
  rest_params = jax.tree.map(
      lambda p, u, part: keep(optax.apply_updates(p, fit(u, p.shape)), p) if part == REST else p,
      params, rest_updates, param_parts, is_leaf=_masked)

  # The stacked weights, a layer at a time.
  layers = {x.shape[0] for x, part in zip(jax.tree.leaves(params), jax.tree.leaves(param_parts))
            if part == STACKED}
  if len(layers) > 1:
    raise ValueError(f'stacked weights with different layer counts: {sorted(layers)}')
  # Every layer starts from the step's counts (None where a leaf is a layer's own).
  counts = jax.tree.map(lambda x, part: x if part == SHARED else None, opt_state, state_parts,
                        is_leaf=_masked)

  def in_place(path, p, part):
    """A stacked weight kept in its stored placement through the loop (XLA would otherwise carry
    it as the optimizer places it and gather the whole stack after the loop: 2 full-size copies of
    an MLP weight at 100m ZeRO-2)."""
    if part != STACKED:
      return p
    layer = plan.layer_shardings[jax.tree_util.keystr(path)]
    return jax.lax.with_sharding_constraint(
        p, NamedSharding(layer.mesh, PartitionSpec(None, *layer.spec)))

  def layer_update(stored, inputs):
    """One layer: its state arrives sliced from host memory (the scan's input) and leaves for host
    memory (the scan's output, stacked there), as XLA streams offloaded activations."""
    layer, state = inputs
    stored = jax.tree_util.tree_map_with_path(in_place, stored, param_parts)
    layer_state = to_device(jax.tree.map(lambda x, c: x if c is None else c, state, counts,
                                         is_leaf=_masked))
    updates, new_state = tx.update(select(grads, STACKED, layer), layer_state,
                                   select(stored, STACKED, layer))
    new_state = to_host(jax.tree.map(keep, new_state, layer_state, is_leaf=_masked))

    def write(path, p, u, part):
      if part != STACKED:
        return p
      new = keep(optax.apply_updates(p[layer], fit(u, p.shape[1:])), p[layer])
      new = jax.lax.with_sharding_constraint(new, plan.layer_shardings[jax.tree_util.keystr(path)])
      return jax.lax.dynamic_update_index_in_dim(p, new, layer, 0)
    stored = jax.tree_util.tree_map_with_path(write, stored, updates, param_parts, is_leaf=_masked)
    return stored, _part(new_state, state_parts, STACKED, shared=False)

  if layers:
    count = layers.pop()
    new_params, stacked_state = jax.lax.scan(
        layer_update, rest_params,
        (jax.numpy.arange(count), _part(opt_state, state_parts, STACKED, shared=False)))
  else:
    new_params, stacked_state = rest_params, opt_state
  return new_params, _join(stacked_state, rest_state, state_parts)


def _host_update(plan: OffloadedOptimizer, grads, opt_state, params, norm, finite):
  """The whole update computed by the host's processor where the state lives (ZeRO-Offload's
  design; `parallel.offload_update='host'`): the gradients and the weights, cut on the device to
  the optimizer's shards and shapes, go to host memory in their stored dtype (bf16 under
  bf16_master: 4 bytes a parameter), the update runs there in one host computation, and the new
  weights come back (2 bytes) to be laid out as the parameters are; no byte of the master or the
  moments reaches the device (the streamed update moves 12 bytes a parameter each way). Its
  results are new buffers, not the old state's (train/donation.py: `written_anew` holds every
  leaf back), so host memory holds the old and the new state at once. On XLA:CPU host and device
  are one memory and this is the same arithmetic as the streamed update."""
  def step(grads, opt_state, params, norm, finite):
    updates, new_state = plan.tx_for_norm(norm).update(grads, opt_state, params)
    keep = lambda new, old: new if _masked(new) else jax.numpy.where(finite, new, old)
    return (jax.tree.map(keep, optax.apply_updates(params, updates), params),
            jax.tree.map(keep, new_state, opt_state, is_leaf=_masked))
  host_step = _on_host(step, out_memory_spaces=(jax.memory.Space.Device, jax.memory.Space.Host))
  as_optimizer = lambda tree: jax.tree_util.tree_map_with_path(plan.for_optimizer, tree)
  new_params, new_state = host_step(to_host(as_optimizer(grads)), opt_state,
                                    to_host(as_optimizer(params)), to_host(norm), to_host(finite))
  return jax.tree.map(lambda p, new: fit(new, p.shape), params, new_params), new_state


def _on_host(fn, out_memory_spaces):
  """`fn` computed by the host's processor, its results placed in `out_memory_spaces` (a prefix
  of its results' tree): jax.experimental.compute_on's function form, `compute_on2` on jax 0.10
  (where `compute_on` is a context manager), `compute_on` since."""
  from jax.experimental import compute_on as module
  wrap = getattr(module, 'compute_on2', module.compute_on)
  return wrap(fn, compute_type='device_host', out_memory_spaces=out_memory_spaces)
