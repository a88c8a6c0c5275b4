"""Zero-bubble pipelines (`parallel.pipeline_schedule=zb_h1`): 1F1B's loop with each microbatch's
backward pass on a stage split into B (its input's gradient, which the stage before waits for) and
W (its weights', which nothing waits for), W put off into the ticks where the stage would wait
(parallel/zero_bubble.py's tables).

One compiled program, as the other schedules': a `shard_map` manual over `stage` only (`data`,
`fsdp` and `tensor` stay the partitioner's, inside a stage as without a pipeline) and a scan over
the table's ticks. In each tick each stage takes its own action, as real branches (`lax.cond` on
its row of the table; the other schedules' vmap over stages would compute every branch), then
every F's output moves one stage on and every B's one stage back (a ppermute each way).

F runs its chunk under `jax.vjp` and keeps, in its microbatch's slot, the pullback's residuals
that depend on the microbatch (its input, rows and dropout keys; what they are is the model's
remat policy's: a layer's input under `full`). The residuals that depend on the weights alone (the
weights, their casts) are made once per step, before the loop, not per slot. B calls the pullback
for the input's gradient, W for the weights', and XLA drops the half each does not use: nothing is
recomputed, so F, B and W each cost about a forward pass, as the tables count them. The first
stage's F embeds its microbatch; the last stage's F runs the final norm, head and loss, and keeps
the loss's gradient in the slot for its B. Gradients are summed as 1F1B sums them (its custom_vjp,
`OneFOneB.loss_sum`, hands them to autodiff).
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen
from jax.extend import core as jax_core
from jax.sharding import PartitionSpec

from parallel.pipeline import STAGE_AXIS, on_stages, scan_chunk, split_rows
from parallel.pipeline_1f1b import (OneFOneB, _added, _in_stages, _take, _Trained,
                                    embedding_grads, embeds_after, placed_vocabulary)
from parallel.rules import without_axis
from parallel.zero_bubble import BACKWARD_INPUT, BACKWARD_WEIGHTS, FORWARD


@dataclasses.dataclass(frozen=True)
class ZeroBubble(OneFOneB):
  """OneFOneB's interface (evaluation through GPipe's forward, `loss_sum` for the train step),
  with ZB-H1's loop. The embedding and the head run on their stages' branches, so their tables
  enter the loop whole over `stage` (gathered once per step; stored split over it)."""
  stage_manual = True

  def _loop(self):
    return _run


def _run(schedule, placements, rolled_backward, layer, keys, rows, embed, embed_rows, tail,
         targets, seed, weights, wanted):
  """(loss sum, gradients of `weights` = (layers, embedding's, tail's): None where `wanted` is
  False); `wanted` None: the loss alone. Arguments as parallel/pipeline_1f1b.py's `_run`'s;
  `rolled_backward` does not apply (nothing is recomputed)."""
  del rolled_backward
  P, M = schedule.stages, schedule.microbatches
  if wanted is None:
    wanted = jax.tree.map(lambda _: False, weights)
  weights = placed_vocabulary(weights, placements)
  layers, embed_weights, tail_weights = (_Trained(w, want) for w, want in zip(weights, wanted))
  layer_split = schedule.layer_split(layers.leaves[0].shape[0])
  split = lambda tree: jax.tree.map(lambda a: split_rows(jnp.asarray(a), M), tree)
  # [stages, 1, chunk, ...]: stage p's chunk, placed once per step (ZeRO-3: gathered once).
  stage_leaves = [_in_stages(place)(on_stages(layer_split.take(a)))
                  for a, place in zip(layers.leaves, jax.tree.leaves(placements[0]))]
  stage_keys = None if keys is None else layer_split.take(keys)
  stage_valid = layer_split.valid()
  place_grads = [_Trained(p, want).trained() for p, want in zip(placements[1], wanted)]
  loop = _Stage(schedule.zero_bubble, layer, layers, embed_weights, tail_weights, embed, tail,
                place_grads, embeds_after(schedule, embed, embed_weights, split(embed_rows)))

  stage, whole = PartitionSpec(STAGE_AXIS), PartitionSpec()
  run = jax.shard_map(
      loop.run, axis_names={STAGE_AXIS}, check_vma=False,
      in_specs=(stage, stage if keys is not None else whole,
                stage if stage_valid is not None else whole, whole, whole, whole, whole, whole,
                whole),
      out_specs=(stage, stage, stage, stage, stage))
  # Inside, `stage` is manual: one stage's arrays, the vocabulary's whole over it.
  with linen.logical_axis_rules(without_axis(linen.get_logical_axis_rules(), STAGE_AXIS)):
    loss, grads, embed_grads, embedded_grads, tail_grads = run(
        stage_leaves, stage_keys, stage_valid, embed_weights.trained(), tail_weights.trained(),
        split(rows), split(embed_rows), split(targets), jnp.asarray(seed, jnp.float32))
  stage_sum = lambda grads: [g.sum(0) for g in grads]
  return loss.sum(), (layers.gradients([layer_split.put_back(g) for g in grads]),
                      embed_weights.gradients(
                          # outside the loop: placed as the step places gradients
                          embedding_grads(embed, embed_weights, embed_rows, embedded_grads[0],
                                          [lambda g: g] * len(place_grads[1]))
                          if loop.embed_after else stage_sum(embed_grads)),
                      tail_weights.gradients(stage_sum(tail_grads)))


@dataclasses.dataclass
class _Stage:
  """One stage's loop (the body of the shard_map over `stage`): its chunk's actions, tick by
  tick, as the tables say."""
  tables: Any
  layer: Any
  layers: _Trained
  embed_weights: _Trained
  tail_weights: _Trained
  embed: Any           # embed(weights, rows) -> one microbatch's first block input
  tail: Any            # tail(weights, hidden, targets, microbatch) -> its loss sum
  place_grads: list    # per (layers, embedding, tail): a placement per trained leaf
  embed_after: bool    # the embedding's gradient formed after the loop (pipeline_1f1b.py)

  def run(self, stage_leaves, stage_keys, stage_valid, embed_trained, tail_trained, micro_rows,
          micro_embed_rows, micro_targets, seed):
    """(loss, gradients of the chunk's, embedding's (or its outputs', `embed_after`) and tail's
    trained weights), each with a leading axis of 1: this stage's share, stacked over `stage` by
    the shard_map."""
    me = jax.lax.axis_index(STAGE_AXIS)
    leaves = [a[0, 0] for a in stage_leaves]   # the stage's one chunk, [chunk, ...] each
    loop = _StageLoop(self, me, leaves, self.layers.trained(leaves),
                      None if stage_keys is None else stage_keys[0, 0],
                      None if stage_valid is None else stage_valid[0, 0], embed_trained,
                      tail_trained, micro_rows, micro_embed_rows, micro_targets, seed)
    table = {k: jnp.asarray(getattr(self.tables, k)) for k in (
        'action', 'micro', 'forward_arrives', 'forward_micro', 'backward_arrives',
        'backward_micro')}
    carry = jax.lax.scan(loop.tick, loop.first_carry(), table)[0]
    one = lambda a: a[None]
    return (one(carry['loss']), [g[None] for g in carry['grads']],
            [one(g) for g in carry['embed_grads']], jax.tree.map(one, carry['embedded_grads']),
            [one(g) for g in carry['tail_grads']])


class _StageLoop:
  """What one stage's ticks read (its weights, keys, microbatches, and the pullback's split into
  per-microbatch and per-step residuals); its methods are the tick and its three actions. Each
  action is a branch from the carry's entries it changes to their new values; where the stage
  takes another action they pass through. (XLA wants a conditional's results placed alike in
  both branches: hence the placements of the gradients' sums and the activations.)"""

  def __init__(self, stage: _Stage, me, leaves, trained, keys, valid, embed_trained,
               tail_trained, micro_rows, micro_embed_rows, micro_targets, seed):
    self.s, self.me, self.leaves, self.trained, self.keys = stage, me, leaves, trained, keys
    self.valid = valid   # the chunk's slots that run a layer (None: all)
    self.first, self.last = me == 0, me == stage.tables.stages - 1
    self.embed_trained, self.tail_trained, self.seed = embed_trained, tail_trained, seed
    self.micro_rows, self.micro_embed_rows = micro_rows, micro_embed_rows
    self.micro_targets = micro_targets
    self.slots = stage.tables.slots
    self.activation = jax.eval_shape(lambda: self.embed_of(0)(embed_trained))
    self.x0 = stream(jnp.zeros(self.activation.shape, self.activation.dtype))
    self.residuals = Residuals.of(self.pullback, trained, self.x0, *self.chunk_inputs(0))

  def chunk_inputs(self, m):
    """The microbatch's per-row inputs and dropout keys (a mask per layer and microbatch)."""
    chunk_keys = None
    if self.keys is not None:
      chunk_keys = jax.vmap(lambda k: jax.random.fold_in(k, m))(self.keys)
    return _take(self.micro_rows, m), chunk_keys

  def pullback(self, trained, x, rows_now, chunk_keys):
    """(the chunk's output, its pullback) at `trained` weights and input `x`."""
    def apply(trained, x):
      weights = self.s.layers.with_trained(trained, self.leaves)
      return scan_chunk(self.s.layer, weights, x, chunk_keys, rows_now, unroll=True,
                        valid=self.valid)
    return jax.vjp(apply, trained, x)

  def embed_of(self, m):
    return lambda w: self.s.embed(self.s.embed_weights.with_trained(w),
                                  _take(self.micro_embed_rows, m))

  def forward(self, c, m, held):
    """F: the chunk on the microbatch's input (the first stage embeds it); its residuals kept;
    on the last stage the loss, the tail's gradient, and the gradient its B starts from."""
    slot, x0 = m % self.slots, self.x0
    x = jax.lax.cond(self.first,
                     lambda: stream(self.embed_of(m)(self.embed_trained).astype(x0.dtype)),
                     lambda: stream(held))
    y, pull = self.pullback(self.trained, x, *self.chunk_inputs(m))
    c['kept'] = [_put(k, leaf, slot) for k, leaf in zip(c['kept'], self.residuals.per_item(pull))]
    c['forward_out'] = stream(y.astype(x0.dtype))

    def head(loss, tail_grads, dy):
      tail_of = lambda w, y: self.s.tail(self.s.tail_weights.with_trained(w), y,
                                         self.micro_targets[m], m)
      loss_now, tail_vjp = jax.vjp(tail_of, self.tail_trained, y)
      d_tail, d_y = tail_vjp(self.seed)
      return (loss + loss_now, _added(tail_grads, d_tail, True, self.s.place_grads[2]),
              _put(dy, d_y, slot))
    c['loss'], c['tail_grads'], c['dy'] = jax.lax.cond(
        self.last, head, lambda *a: a, c['loss'], c['tail_grads'], c['dy'])
    return c

  def input_grad(self, c, m, kept, dy):
    """B: the gradient of the chunk's input (on the first stage, of the embedding's weights, or
    kept for them)."""
    dx = self.residuals.pullback(kept)(dy)[1]
    c['backward_out'] = stream(dx.astype(self.x0.dtype))
    if self.s.embed_after:
      e = c['embedded_grads']
      c['embedded_grads'] = jax.lax.dynamic_update_index_in_dim(
          e, jnp.where(self.first, dx.astype(e.dtype), e[m]), m, 0)
      return c
    embed_vjp = lambda: jax.vjp(self.embed_of(m), self.embed_trained)[1]
    c['embed_grads'] = jax.lax.cond(
        self.first, lambda g: _added(g, embed_vjp()(dx.astype(self.activation.dtype))[0], True,
                                     self.s.place_grads[1]),
        lambda g: g, c['embed_grads'])
    return c

  def weight_grad(self, c, kept, dy):
    """W: the gradient of the chunk's weights, added to the stage's sums."""
    d_weights = self.residuals.pullback(kept)(dy)[0]
    c['grads'] = [place(g + d[None].astype(g.dtype))
                  for g, d, place in zip(c['grads'], d_weights, self.s.place_grads[0])]
    return c

  def tick(self, carry, row):
    """What arrived filed into its slot, the stage's action of the tick, then the sends."""
    t = jax.tree.map(lambda a: a[self.me], row)
    slots = self.slots
    slot = t['micro'] % slots
    carry['inputs'] = _put(carry['inputs'], carry['forward_in'], t['forward_micro'] % slots,
                           t['forward_arrives'])
    carry['dy'] = _put(carry['dy'], carry['backward_in'], t['backward_micro'] % slots,
                       t['backward_arrives'])
    changes = lambda *keys: {k: carry[k] for k in keys}
    carry.update(jax.lax.cond(
        t['action'] == FORWARD, self.forward, lambda c, m, held: c,
        changes('kept', 'forward_out', 'loss', 'tail_grads', 'dy'), t['micro'],
        carry['inputs'][slot]))
    kept, dy = [k[slot] for k in carry['kept']], carry['dy'][slot]
    carry.update(jax.lax.cond(
        t['action'] == BACKWARD_INPUT, self.input_grad, lambda c, m, kept, dy: c,
        changes('backward_out', 'embed_grads', 'embedded_grads'), t['micro'], kept, dy))
    carry.update(jax.lax.cond(
        t['action'] == BACKWARD_WEIGHTS, self.weight_grad, lambda c, kept, dy: c,
        changes('grads'), kept, dy))
    # Every F's output one stage on, every B's one stage back (what no action made is sent too,
    # and not read: the tables say what arrives).
    stages = self.s.tables.stages
    carry['forward_in'] = jax.lax.ppermute(carry['forward_out'], STAGE_AXIS,
                                           [(i, (i + 1) % stages) for i in range(stages)])
    carry['backward_in'] = jax.lax.ppermute(carry['backward_out'], STAGE_AXIS,
                                            [(i, (i - 1) % stages) for i in range(stages)])
    return carry, None

  def first_carry(self) -> dict:
    """The loop's state before its first tick: nothing in flight or kept, every sum zero."""
    x0, slots = self.x0, self.slots
    places = self.s.place_grads
    zeros = lambda shapes, places, lead=(): [place(jnp.zeros(lead + a.shape, a.dtype))
                                             for a, place in zip(shapes, places)]
    return {
        'forward_in': x0, 'backward_in': x0, 'forward_out': x0, 'backward_out': x0,
        'inputs': jnp.zeros((slots,) + x0.shape, x0.dtype),
        'dy': jnp.zeros((slots,) + x0.shape, x0.dtype),
        'kept': [jnp.zeros((slots,) + a.shape, a.dtype) for a in self.residuals.item_shapes],
        'grads': zeros(self.trained, places[0], (1,)),
        'embed_grads': [] if self.s.embed_after else zeros(self.embed_trained, places[1]),
        'embedded_grads': (jnp.zeros((self.s.tables.microbatches,) + self.activation.shape,
                                     self.activation.dtype) if self.s.embed_after else None),
        'tail_grads': zeros(self.tail_trained, places[2]),
        'loss': jnp.zeros((), jnp.float32),
    }


@dataclasses.dataclass
class Residuals:
  """A chunk's pullback split in two: the leaves that depend on a microbatch (kept per slot) and
  those that depend on the weights alone (made once per step)."""
  treedef: Any
  step_leaves: list    # every leaf of a pullback made once per step; those per item unused
  item: list           # indices of the leaves that depend on the microbatch
  item_shapes: list

  @classmethod
  def of(cls, pullback, trained, x, rows, chunk_keys) -> 'Residuals':
    leaves, treedef = jax.tree.flatten(pullback(trained, x, rows, chunk_keys)[1])
    args = (trained, x, rows, chunk_keys)
    flat_args, args_tree = jax.tree.flatten(args)
    item_args = jax.tree.leaves((jax.tree.map(lambda _: False, trained),
                                 jax.tree.map(lambda _: True, (x, rows, chunk_keys))))
    jaxpr = jax.make_jaxpr(lambda *flat: jax.tree.leaves(
        pullback(*jax.tree.unflatten(args_tree, flat))[1]))(*flat_args)
    item = [i for i, on in enumerate(_depends(jaxpr.jaxpr, item_args)) if on]
    return cls(treedef, leaves, item, [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                                       for i in item])

  def per_item(self, pull) -> list:
    leaves = jax.tree.leaves(pull)
    assert len(leaves) == len(self.step_leaves), 'a pullback of another form'
    return [leaves[i] for i in self.item]

  def no_item(self) -> list:
    return [jnp.zeros(a.shape, a.dtype) for a in self.item_shapes]

  def pullback(self, kept: list):
    leaves = list(self.step_leaves)
    for i, leaf in zip(self.item, kept):
      leaves[i] = leaf
    return jax.tree.unflatten(self.treedef, leaves)


def _depends(jaxpr, marked: list[bool]) -> list[bool]:
  """Which outputs of `jaxpr` depend on an input marked True (through scans, calls and remat:
  the casts of a scan's weights are not marked by its carried activations)."""
  on = {v for v, m in zip(jaxpr.invars, marked) if m}
  is_on = lambda v: not isinstance(v, jax_core.Literal) and v in on
  for eqn in jaxpr.eqns:
    ins = [is_on(v) for v in eqn.invars]
    if any(ins):
      on.update(v for v, m in zip(eqn.outvars, _eqn_depends(eqn, ins)) if m)
  return [is_on(v) for v in jaxpr.outvars]


def _eqn_depends(eqn, ins: list[bool]) -> list[bool]:
  if eqn.primitive.name == 'scan':
    body, params = eqn.params['jaxpr'].jaxpr, eqn.params
    if 'num_consts' in params:
      consts, carries = params['num_consts'], params['num_carry']
    else:   # jax 0.11 on: `ft_in`, a flat tree of (consts, carry, xs)
      consts, carries, _ = (len(list(part.vals)) for part in params['ft_in'].elts)
    carry = ins[consts:consts + carries]
    while True:   # until what the carry depends on stops growing
      out = _depends(body, ins[:consts] + carry + ins[consts + carries:])
      grown = [a or b for a, b in zip(carry, out[:carries])]
      if grown == carry:
        return carry + out[carries:]
      carry = grown
  for value in eqn.params.values():
    inner = getattr(value, 'jaxpr', value)   # a ClosedJaxpr's, or a Jaxpr
    if (isinstance(inner, jax_core.Jaxpr) and len(inner.invars) == len(eqn.invars)
        and len(inner.outvars) == len(eqn.outvars)):
      return _depends(inner, ins)
  return [True] * len(eqn.outvars)


def _put(buffer, value, index, keep=True):
  """`buffer` with `value` at `index` where `keep`, as it was elsewhere."""
  value = value.astype(buffer.dtype)
  if keep is not True:
    value = jnp.where(keep, value, buffer[index])
  return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def stream(x: jax.Array) -> jax.Array:
  """The residual stream's placement (as models/layers.py gives a block's output)."""
  return linen.with_logical_constraint(x, ('batch', 'length', 'embed'))
