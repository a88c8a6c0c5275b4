"""Zero-bubble pipelines (`parallel.pipeline_schedule=zb_h1`): 1F1B's loop with each microbatch's
backward pass on a stage split into B (its input's gradient, which the stage before waits for) and
W (its weights', which nothing waits for), W put off into the ticks where the stage would wait
(parallel/zero_bubble.py's tables).

One compiled program, as the other schedules': a scan over the table's ticks. In each tick each
stage takes its own action in a `shard_map` manual over `stage` only (`data`, `fsdp` and `tensor`
stay the partitioner's, inside a stage as without a pipeline), as real branches (`when` of
parallel/in_place.py on its row of the table: each action changes only its own state, in place;
the other schedules' vmap over stages would compute every branch), then every F's output moves
one stage on and every B's one stage back (a ppermute each way). The embedding
and the head run outside it, as 1F1B's do, with the vocabulary split over `stage`
(parallel/rules.py): the embedding before the stages' actions where the first stage's F needs it,
the head, loss and loss gradient after them where the last stage's F made an output.

F runs its chunk under `jax.vjp` and keeps, in its microbatch's slot, the pullback's residuals
that depend on the microbatch (its input, rows and dropout keys; what they are is the model's
remat policy's: a layer's input under `full`). The residuals that depend on the weights alone (the
weights, and their casts where the product keeps them: off the CPU without remat a float product
casts again in its backward, models/dense.py) are made once per step, before the loop, not per
slot. B calls the pullback
for the input's gradient, W for the weights', and XLA drops the half each does not use: nothing is
recomputed beyond what the remat policy recomputes (under remat, B and W each run the layers'
forward again from the kept inputs, a layer at a time in a loop), so without remat F, B and W each
cost about a forward pass, as the tables count them. The loss's
gradient waits in the last stage's slot for its B. Gradients are summed as 1F1B sums them (its
custom_vjp, `OneFOneB.loss_sum`, hands them to autodiff).
"""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen
from jax.extend import core as jax_core
from jax.sharding import PartitionSpec

from parallel.in_place import when
from parallel.pipeline import STAGE_AXIS, at, on_stages, scan_chunk, split_rows
from parallel.pipeline_1f1b import (OneFOneB, _added, _in_stages, _take, _Trained,
                                    embedding_grads, embeds_after, placed_vocabulary)
from parallel.rules import without_axis
from parallel.zero_bubble import BACKWARD_INPUT, BACKWARD_WEIGHTS, FORWARD


@dataclasses.dataclass(frozen=True)
class ZeroBubble(OneFOneB):
  """OneFOneB's interface (evaluation through GPipe's forward, `loss_sum` for the train step),
  with ZB-H1's loop."""

  def _loop(self):
    return _run


def _run(schedule, placements, rolled_backward, layer, keys, rows, embed, embed_rows, tail,
         targets, seed, weights, wanted):
  """(loss sum, gradients of `weights` = (layers, embedding's, tail's): None where `wanted` is
  False); `wanted` None: the loss alone. Arguments as parallel/pipeline_1f1b.py's `_run`'s."""
  if wanted is None:
    wanted = jax.tree.map(lambda _: False, weights)
  weights = placed_vocabulary(weights, placements)
  layers, embed_weights, tail_weights = (_Trained(w, want) for w, want in zip(weights, wanted))
  layer_split = schedule.layer_split(layers.leaves[0].shape[0])
  split = lambda tree: jax.tree.map(lambda a: split_rows(jnp.asarray(a), schedule.microbatches),
                                    tree)
  place_grads = [_Trained(p, want).trained() for p, want in zip(placements[1], wanted)]
  micro_embed_rows = split(embed_rows)
  ends = _Ends(embed_weights, tail_weights, embed, tail, micro_embed_rows, split(targets),
               place_grads, jnp.asarray(seed, jnp.float32),
               embeds_after(schedule, embed, embed_weights, micro_embed_rows))
  # [stages, 1, chunk, ...]: stage p's chunk, placed once per step (ZeRO-3: gathered once).
  stage_leaves = [_in_stages(place)(on_stages(layer_split.take(a)))
                  for a, place in zip(layers.leaves, jax.tree.leaves(placements[0]))]
  stages = _Stages(schedule.zero_bubble, layer, layers, place_grads[0], stage_leaves,
                   None if keys is None else layer_split.take(keys), layer_split.valid(),
                   split(rows), ends.first_shape(), rolled_backward)
  step_leaves, staged = stages.prepare()
  tables = schedule.zero_bubble
  table = {k: jnp.asarray(getattr(tables, k)) for k in (
      'action', 'micro', 'forward_arrives', 'forward_micro', 'backward_arrives', 'backward_micro')}

  def tick(carry, row):
    """The embedding where the first stage's F needs it, every stage's action and sends, the
    head where the last stage's F made an output, the embedding's gradient where the first
    stage's B made one."""
    first = ends.embedded(row['action'][0] == FORWARD, row['micro'][0])
    staged = stages.tick(step_leaves, carry['staged'], row, first, carry['head_dy'],
                         carry['head_micro'])
    carry = ends.head(dict(carry, staged=staged), row['action'][-1] == FORWARD, row['micro'][-1])
    return ends.embedding_grad(carry, row['action'][0] == BACKWARD_INPUT, row['micro'][0]), None

  carry = jax.lax.scan(tick, ends.first_carry(staged), table)[0]
  return carry['loss'], (
      layers.gradients([layer_split.put_back(g) for g in carry['staged']['grads']]),
      embed_weights.gradients(embedding_grads(embed, embed_weights, embed_rows,
                                              carry['embedded_grads'], place_grads[1])
                              if ends.embed_after else carry['embed_grads']),
      tail_weights.gradients(carry['tail_grads']))


@dataclasses.dataclass
class _Ends:
  """The pipeline's two ends, run between the stages' actions on the whole mesh (the vocabulary
  split over `stage`): the embedding of a microbatch, the head, loss and loss gradient of one,
  and the sums of their weights' gradients."""
  embed_weights: _Trained
  tail_weights: _Trained
  embed: Any           # embed(weights, rows) -> one microbatch's first block input
  tail: Any            # tail(weights, hidden, targets, microbatch) -> its loss sum
  micro_embed_rows: Any
  micro_targets: Any
  place_grads: list    # per (layers, embedding, tail): a placement per trained leaf
  seed: jax.Array      # the cotangent the loss sum will get
  embed_after: bool    # the embedding's gradient formed after the loop (pipeline_1f1b.py)

  def embed_of(self, m):
    return lambda w: self.embed(self.embed_weights.with_trained(w), _take(self.micro_embed_rows, m))

  def first_shape(self) -> jax.ShapeDtypeStruct:
    return jax.eval_shape(self.embed_of(0), self.embed_weights.trained())

  def embedded(self, needed, m) -> jax.Array:
    """Microbatch m's first block input where `needed`, zeros elsewhere."""
    shape = self.first_shape()
    return jax.lax.cond(needed, lambda: stream(self.embed_of(m)(self.embed_weights.trained())),
                        lambda: stream(jnp.zeros(shape.shape, shape.dtype)))

  def head(self, carry, leaving, m) -> dict:
    """Where microbatch m left the last stage's chunk (`leaving`): its loss added, the head's
    gradient summed, and the gradient of the chunk's output (`head_dy`) handed to the last stage
    at the next tick, for its B (`head_micro`: m, or -1 where none left)."""
    y = carry['staged']['forward_out'][-1]

    def run(sums):
      loss, tail_grads, _ = sums
      tail_of = lambda w, y: self.tail(self.tail_weights.with_trained(w), y, self.micro_targets[m],
                                       m)
      loss_now, tail_vjp = jax.vjp(tail_of, self.tail_weights.trained(), y)
      d_tail, d_y = tail_vjp(self.seed)
      return (loss + loss_now, _added(tail_grads, d_tail, True, self.place_grads[2]),
              stream(d_y.astype(y.dtype)))
    # Where none left, `head_dy` keeps the last one's: `head_micro` -1 says it is not to be read.
    carry['loss'], carry['tail_grads'], carry['head_dy'] = when(
        leaving, run, (carry['loss'], carry['tail_grads'], carry['head_dy']))
    carry['head_micro'] = jnp.where(leaving, m, -1)
    return carry

  def embedding_grad(self, carry, made, m) -> dict:
    """Where the first stage's B made the gradient of microbatch m's input (`made`): the
    embedding's gradient added to its sum, or (`embed_after`) that input gradient kept for it."""
    if not self.embed_weights.indices:
      return carry
    dx = carry['staged']['backward_out'][0]
    if self.embed_after:
      e = carry['embedded_grads']
      carry['embedded_grads'] = jax.lax.dynamic_update_index_in_dim(
          e, jnp.where(made, dx.astype(e.dtype), e[m]), m, 0)
      return carry
    shape = self.first_shape()
    embed_vjp = lambda: jax.vjp(self.embed_of(m), self.embed_weights.trained())[1]
    carry['embed_grads'] = when(
        made, lambda g: _added(g, embed_vjp()(dx.astype(shape.dtype))[0], True,
                               self.place_grads[1]),
        carry['embed_grads'])
    return carry

  def first_carry(self, staged) -> dict:
    """The loop's state before its first tick: the stages' (`staged`), and every sum zero."""
    shape = self.first_shape()
    zeros = lambda shapes, places: [place(jnp.zeros(a.shape, a.dtype))
                                    for a, place in zip(shapes, places)]
    return {
        'staged': staged,
        'head_dy': stream(jnp.zeros(shape.shape, shape.dtype)), 'head_micro': jnp.int32(-1),
        'embed_grads': [] if self.embed_after else zeros(self.embed_weights.trained(),
                                                         self.place_grads[1]),
        'embedded_grads': (jnp.zeros((self.micro_targets.shape[0],) + shape.shape, shape.dtype)
                           if self.embed_after else None),
        'tail_grads': zeros(self.tail_weights.trained(), self.place_grads[2]),
        'loss': jnp.zeros((), jnp.float32),
    }


@dataclasses.dataclass
class _Stages:
  """Every stage's part of a tick, in a `shard_map` manual over `stage` (inside it, the rules
  without `stage`: its arrays are one stage's): its action, as its row of the table says, and the
  sends. Its state (`staged`) is [stages, ...] outside, one stage's [1, ...] inside."""
  tables: Any
  layer: Any
  layers: _Trained
  place_grads: list      # the stacked layers' gradients': a placement per trained leaf
  stage_leaves: list     # [stages, 1, chunk, ...] each: the stage's chunk
  stage_keys: Any        # dropout keys the same way, or None
  stage_valid: Any       # [stages, 1, chunk] bool: the slots that run a layer, or None
  micro_rows: Any        # per-row inputs of the blocks, [microbatches, rows, ...]
  first: jax.ShapeDtypeStruct   # one microbatch's first block input
  # Under remat: the chunk's layers in a loop. Straight-line, B's and W's pullbacks recompute
  # every layer's forward first and keep them all (7b, 8-layer chunks, M 8, 8 H100s, bench.buffers
  # --target: 47.2 GiB a device against 1F1B's 28.9, the chunk's recomputed MLP activations).
  rolled: bool = False

  def _per_stage(self, body, in_specs, out_specs, *args):
    """`body`(the stage's leaves, keys, valid slots, microbatch rows, *args) run per stage."""
    stage, whole = PartitionSpec(STAGE_AXIS), PartitionSpec()
    run = jax.shard_map(
        body, axis_names={STAGE_AXIS}, check_vma=False, out_specs=out_specs,
        in_specs=(stage, whole if self.stage_keys is None else stage,
                  whole if self.stage_valid is None else stage, whole) + in_specs)
    with linen.logical_axis_rules(without_axis(linen.get_logical_axis_rules(), STAGE_AXIS)):
      return run(self.stage_leaves, self.stage_keys, self.stage_valid, self.micro_rows, *args)

  def _loop(self, stage_leaves, stage_keys, stage_valid, micro_rows, step_leaves=None):
    leaves = [a[0, 0] for a in stage_leaves]   # the stage's one chunk, [chunk, ...] each
    return _StageLoop(self, jax.lax.axis_index(STAGE_AXIS), leaves, self.layers.trained(leaves),
                      None if stage_keys is None else stage_keys[0, 0],
                      None if stage_valid is None else stage_valid[0, 0], micro_rows, step_leaves)

  def prepare(self):
    """(the residuals of each stage's pullback that depend on its weights alone, made once per
    step; the stages' state before the first tick), [stages, ...] each."""
    def body(*inputs):
      loop = self._loop(*inputs)
      one = lambda a: a[None]
      return [one(a) for a in loop.residuals.weight_leaves()], jax.tree.map(one, loop.first_carry())
    stage = PartitionSpec(STAGE_AXIS)
    return self._per_stage(body, (), (stage, stage))

  def tick(self, step_leaves, staged, row, first, head_dy, head_micro):
    """The stages' state after their actions of the tick (`row`: the table's, every stage's)
    and the sends; `first`: the first stage's input where its F needs one; `head_dy`: the
    gradient of the last stage's output of microbatch `head_micro` at the tick before (-1:
    none)."""
    def body(*inputs):
      *inputs, step_leaves, staged, row, first, head_dy, head_micro = inputs
      loop = self._loop(*inputs, [a[0] for a in step_leaves])
      # The residual slots keep the stage's leading 1: taking it off and putting it back each
      # tick, XLA gives them another layout where a microbatch is one row, copying every slot
      # (100m without remat, M 16: 0.66 GiB).
      local = lambda tree, put: {k: v if k == 'kept' else jax.tree.map(put, v)
                                 for k, v in tree.items()}
      carry = loop.tick(local(staged, lambda a: a[0]), row, first, head_dy, head_micro)
      return local(carry, lambda a: a[None])
    stage, whole = PartitionSpec(STAGE_AXIS), PartitionSpec()
    return self._per_stage(body, (stage, stage, whole, whole, whole, whole), stage, step_leaves,
                           staged, row, first, head_dy, head_micro)


class _StageLoop:
  """What one stage's tick reads (its weights, keys, microbatches, and the pullback's split into
  per-microbatch and per-step residuals); its methods are the tick and its actions. Each action
  runs where the stage's row says so (`when`), from the state it changes (F: the slot stores and
  its output; B: its output; W: the gradients' sums) and what it reads to that state's new value.
  (XLA wants a conditional's results placed alike in both branches: hence the placements of the
  gradients' sums and the activations.)"""

  def __init__(self, stages: _Stages, me, leaves, trained, keys, valid, micro_rows,
               step_leaves=None):
    self.s, self.me, self.leaves, self.trained, self.keys = stages, me, leaves, trained, keys
    self.valid = valid   # the chunk's slots that run a layer (None: all)
    self.first, self.last = me == 0, me == stages.tables.stages - 1
    self.micro_rows = micro_rows
    self.slots = stages.tables.slots
    self.x0 = stream(jnp.zeros(stages.first.shape, stages.first.dtype))
    self.residuals = Residuals.of(self.pullback, trained, self.x0, *self.chunk_inputs(0))
    if step_leaves is not None:   # made once per step (`_Stages.prepare`)
      self.residuals = self.residuals.with_weight_leaves(step_leaves)

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
      return scan_chunk(self.s.layer, weights, x, chunk_keys, rows_now, unroll=not self.s.rolled,
                        valid=self.valid)
    return jax.vjp(apply, trained, x)

  def forward(self, kept, a):
    """F: the chunk on the microbatch's input (on the first stage, its embedding `first`); its
    residuals filed in the slot stores `kept`, its output sent on (from the last stage, to the
    head)."""
    x0 = self.x0
    x = jax.lax.cond(self.first, lambda: stream(a['first'].astype(x0.dtype)),
                     lambda: stream(a['held']))
    y, pull = self.pullback(self.trained, x, *self.chunk_inputs(a['micro']))
    made = self.residuals.per_item(pull)
    return ([k.at[0, a['slot']].set(leaf.astype(k.dtype)) for k, leaf in zip(kept, made)],
            stream(y.astype(x0.dtype)))

  def input_grad(self, kept, a):
    """B: the gradient of the chunk's input, sent back (from the first stage, to the
    embedding's gradient)."""
    dx = self.residuals.pullback(self._slot(kept, a))(a['dy'])[1]
    return stream(dx.astype(self.x0.dtype))

  def weight_grad(self, grads, kept, a):
    """W: the gradient of the chunk's weights, added to the stage's sums."""
    d_weights = self.residuals.pullback(self._slot(kept, a))(a['dy'])[0]
    return [place(g + d[None].astype(g.dtype))
            for g, d, place in zip(grads, d_weights, self.s.place_grads)]

  @staticmethod
  def _slot(kept, a) -> list:
    return [k[0, a['slot']] for k in kept]

  def tick(self, carry, row, first, head_dy, head_micro):
    """What arrived filed into its slot (on the last stage, the head's gradient), the stage's
    action of the tick, then the sends."""
    t = jax.tree.map(lambda a: at(a, self.me), row)
    slots = self.slots
    slot = t['micro'] % slots
    carry['inputs'] = _put(carry['inputs'], carry['forward_in'], t['forward_micro'] % slots,
                           t['forward_arrives'])
    carry['dy'] = _put(carry['dy'], carry['backward_in'], t['backward_micro'] % slots,
                       t['backward_arrives'])
    carry['dy'] = _put(carry['dy'], head_dy, head_micro % slots, self.last & (head_micro >= 0))
    reads = dict(micro=t['micro'], held=at(carry['inputs'], slot), first=first, slot=slot,
                 dy=at(carry['dy'], slot))
    action = t['action']
    # Each action changes its own state in place (F the slot stores and its output, B its output,
    # W the gradients' sums); a tick of another action leaves that state as it was. One switch
    # over the four actions copied the sums twice a tick and read each slot out and back on every
    # tick but an F (7b, 4 stages: 3.0 and 2.6 GiB; XLA:CPU's step 1.24x this form's).
    carry['kept'], carry['forward_out'] = when(
        action == FORWARD, lambda state, a: self.forward(state[0], a),
        (carry['kept'], carry['forward_out']), reads)
    carry['backward_out'] = when(action == BACKWARD_INPUT,
                                  lambda out, kept, a: self.input_grad(kept, a),
                                  carry['backward_out'], carry['kept'], reads)
    carry['grads'] = when(action == BACKWARD_WEIGHTS, self.weight_grad, carry['grads'],
                           carry['kept'], reads)
    # Every F's output one stage on, every B's one stage back (what no action made is sent too,
    # and not read: the tables say what arrives).
    stages = self.s.tables.stages
    carry['forward_in'] = jax.lax.ppermute(carry['forward_out'], STAGE_AXIS,
                                           [(i, (i + 1) % stages) for i in range(stages)])
    carry['backward_in'] = jax.lax.ppermute(carry['backward_out'], STAGE_AXIS,
                                            [(i, (i - 1) % stages) for i in range(stages)])
    return carry

  def first_carry(self) -> dict:
    """The stage's state before its first tick: nothing in flight or kept, its sums zero."""
    x0, slots = self.x0, self.slots
    return {
        'forward_in': x0, 'backward_in': x0, 'forward_out': x0, 'backward_out': x0,
        'inputs': jnp.zeros((slots,) + x0.shape, x0.dtype),
        'dy': jnp.zeros((slots,) + x0.shape, x0.dtype),
        'kept': [jnp.zeros((slots,) + a.shape, a.dtype) for a in self.residuals.item_shapes],
        'grads': [place(jnp.zeros((1,) + a.shape, a.dtype))
                  for a, place in zip(self.trained, self.s.place_grads)],
    }


@dataclasses.dataclass
class Residuals:
  """A chunk's pullback split in two: the leaves that depend on a microbatch (kept per slot) and
  those that depend on the weights alone (made once per step)."""
  treedef: Any
  step_leaves: list    # every leaf of a pullback made once per step; those per item unused
  item: list           # indices of the leaves that depend on the microbatch
  item_shapes: list
  made: list           # indices of those computed from the weights (casts): not an input itself

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
    inputs = set(jaxpr.jaxpr.invars)
    made = [i for i, v in enumerate(jaxpr.jaxpr.outvars)
            if i not in item and not (isinstance(v, jax_core.Var) and v in inputs)]
    return cls(treedef, leaves, item, [jax.ShapeDtypeStruct(leaves[i].shape, leaves[i].dtype)
                                       for i in item], made)

  def per_item(self, pull) -> list:
    leaves = jax.tree.leaves(pull)
    assert len(leaves) == len(self.step_leaves), 'a pullback of another form'
    return [leaves[i] for i in self.item]

  def weight_leaves(self) -> list:
    """The leaves computed from the weights alone (the weights themselves are not among them:
    a copy of them would take their bytes again)."""
    return [self.step_leaves[i] for i in self.made]

  def with_weight_leaves(self, leaves: list) -> 'Residuals':
    """These residuals with `leaves` (`weight_leaves`' of another trace) in place of theirs."""
    step_leaves = list(self.step_leaves)
    for i, leaf in zip(self.made, leaves, strict=True):
      step_leaves[i] = leaf
    return dataclasses.replace(self, step_leaves=step_leaves)

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
    value = jnp.where(keep, value, at(buffer, index))
  return jax.lax.dynamic_update_index_in_dim(buffer, value, index, 0)


def stream(x: jax.Array) -> jax.Array:
  """The residual stream's placement (as models/layers.py gives a block's output)."""
  return linen.with_logical_constraint(x, ('batch', 'length', 'embed'))
