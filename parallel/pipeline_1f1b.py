"""1F1B pipelines: the backward pass runs inside the pipeline's loop, so a stage keeps the inputs of
a bounded number of microbatches whatever their count (`parallel.pipeline_schedule=1f1b`, and
`interleaved_1f1b` with `parallel.pipeline_repeats` chunks per stage).

One compiled SPMD program over the `stage` axis, as parallel/pipeline.py's: a vmap over stages
laid on the axis. Each tick every stage runs a forward slot (one item, `PipelineSchedule.ticks`)
and a backward slot (another); after each tick the forward outputs move one stage on and the
backward ones one stage back (a roll each way, one collective-permute each). The loop runs in
three scans: the warm-up ticks run only forward slots, the last ticks only backward ones, so the
bubble costs no more than GPipe's.

The backward slot of an item recomputes its chunk's forward from the stage input kept at its
forward (as the circular schedule does) and takes the chunk's vjp: the kept inputs are the only
activations that live from one tick to the next, `PipelineSchedule.in_flight` of them per stage
(2 R P - 1 at most). The head and the loss run inside the loop, one microbatch at a time, as soon
as its last chunk's forward ends on the last stage: its gradient starts that microbatch's backward
in the same tick. They, and the embedding, run between the stages' vmaps, where the vocabulary is
split over `stage` (parallel/rules.py): each stage projects the last stage's output onto its share
of the vocabulary, so no stage holds a whole table or repeats another's product.

A chunk's layers run as straight-line code where they can: a loop over them inside the tick's
loop takes its own copy of the stage's weights, and its gradient sums another (XLA's buffers for
the inner loop; 100m on 4 stages x 2-way ZeRO-3: temp 0.53 GiB in a loop, 0.41 GiB without). The
forward slot is always straight-line (in a loop, jax 0.10.2's XLA:CPU hangs with data, tensor
parallelism and remat together); the backward slot's vjp too, except under remat
(`rolled_backward`), where it stays a loop: straight-line, XLA:CPU runs every layer's
recomputation first and keeps them all (7b, remat full: 120 GiB of temp, against 47 GiB).

Autodiff cannot interleave backward with forward, so the pipeline is a `jax.custom_vjp` whose
forward rule computes the loss and every gradient, and whose backward rule hands the gradients
back. The loss's cotangent must be known up front (`seeded`: the train step's loss scale over the
batch's count of predicted targets), so that the gradients flowing back through the layers are
the ones autodiff would give (fp16 loss scaling, and their rounding); the backward rule rescales by
the cotangent that does arrive over that seed (1 when they agree). Only the inputs autodiff asks
for are differentiated (`symbolic_zeros`): a LoRA base's weights get no gradient.
"""
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax.linen import logical_to_mesh_axes
from jax.sharding import PartitionSpec

from parallel.pipeline import (STAGE_AXIS, PipelineSchedule, at, join_rows, on_stages, pipelined,
                               scan_chunk, split_rows)
from parallel.rules import REPLICATED, LayoutRules


@dataclasses.dataclass(frozen=True)
class OneFOneB:
  """A `models.llama.Stack` for evaluation (the forward-only schedule with the same placement),
  and `loss_sum` for the train step, which runs the head and loss inside the loop."""
  schedule: PipelineSchedule
  rules: LayoutRules | None = None   # where the gradients live (None: left to XLA)
  rolled_backward: bool = False      # under remat: a chunk's backward in a loop over its layers
  seed: jax.Array | None = None      # the cotangent the loss sum will get (train/step.py)

  runs_loss = True   # models/llama.py: hand this stack the head and loss

  def __call__(self, layer, layers, x, keys, rows=None):
    return pipelined(self.schedule.forward_schedule)(layer, layers, x, keys, rows)

  def seeded(self, seed: jax.Array) -> 'OneFOneB':
    return dataclasses.replace(self, seed=seed)

  def _loop(self):
    """The loop that computes the loss sum and the gradients (see `_run`)."""
    return _run

  def loss_sum(self, layer, layers, keys, rows, *, embed, tail, targets, axes) -> jax.Array:
    """The sum of the batch's token losses. The blocks as a Stack gets them (`layer`, the stacked
    `layers`, dropout `keys`, per-row inputs `rows`); `embed` = (embed(weights, rows) -> one
    microbatch's first block input, its weights, the rows it reads [batch, ...]), run on the first
    stage; `tail` = (tail(weights, hidden, targets, microbatch) -> one microbatch's loss sum (final
    norm, head, loss), its weights), run on the last; `targets` [batch, length]; `axes`: the
    logical axes (PartitionSpecs of names) of the layers', embedding's and tail's weights."""
    seed = jnp.float32(1) if self.seed is None else self.seed
    (embed_fn, embed_weights, embed_rows), (tail_fn, tail_weights) = embed, tail
    run = functools.partial(self._loop(), self.schedule, self._placements(axes),
                            self.rolled_backward, layer, keys, rows, embed_fn, embed_rows, tail_fn,
                            targets, seed)

    @jax.custom_vjp
    def pipeline(layers, embed_weights, tail_weights):
      return run((layers, embed_weights, tail_weights), None)[0]

    def forward(layers, embed_weights, tail_weights):
      primals = (layers, embed_weights, tail_weights)
      return run(jax.tree.map(lambda a: a.value, primals),
                 jax.tree.map(lambda a: a.perturbed, primals))

    def backward(grads, cotangent):
      ratio = cotangent / seed
      return jax.tree.map(lambda g: None if g is None else (g * ratio).astype(g.dtype), grads,
                          is_leaf=lambda g: g is None)

    pipeline.defvjp(forward, backward, symbolic_zeros=True)
    return pipeline(layers, embed_weights, tail_weights)

  def _placements(self, axes):
    """(the layers' placement in the loop, the gradients' of (layers, embedding, tail), the
    embedding's and the tail's weights' before the loop): leaf functions of one stage's array,
    the first two applied inside the vmap over stages (which adds the `stage` axis in front). A
    stacked weight, [R, chunk, ...] per stage, is whole over `fsdp` (ZeRO-3 gathers it once per
    step, before the loop: left to XLA, the straight-line chunk's gathers are hoisted out of the
    loop anyway, in a layout that takes more: 100m, 0.73 against 0.41 GiB of temp); its gradient
    is split as the layout's gradients are (ZeRO-2/3: summed into the shard at every tick, a
    reduce-scatter). The embedding's and tail's weights are whole over `fsdp` too (used inside
    the loop, ZeRO-3 would gather them at every tick); their vocabulary stays split over
    `tensor` and `stage`."""
    if self.rules is None:
      return _kept(axes[0]), tuple(_kept(a) for a in axes), _kept(axes[1]), _kept(axes[2])
    gradients = (_placed(axes[0], self.rules.grads, True),
                 _placed(axes[1], self.rules.grads, False),
                 _placed(axes[2], self.rules.grads, False))
    return (_placed(axes[0], REPLICATED, True), gradients, _placed(axes[1], REPLICATED, False),
            _placed(axes[2], REPLICATED, False))


def _placed(tree, table, stacked: bool):
  """A placement per leaf of `tree` (logical axes, as PartitionSpecs), by the rules `table`;
  `stacked`: of one stage's [R, chunk, ...] stack of the layers' weights."""
  def place(logical):
    spec = logical_to_mesh_axes(logical, table)
    spec = PartitionSpec(None, None, *spec[1:]) if stacked else spec
    return lambda a: jax.lax.with_sharding_constraint(a, spec)
  return jax.tree.map(place, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


def _kept(tree):
  """A placement per leaf of `tree` that leaves it where XLA puts it."""
  return jax.tree.map(lambda _: lambda a: a, tree, is_leaf=lambda x: isinstance(x, PartitionSpec))


class _Trained:
  """A pytree of weights of which some are differentiated: `trained` lists those leaves, and
  `with_trained` puts values for them back among the others."""

  def __init__(self, tree, wanted):
    self.leaves, self.treedef = jax.tree.flatten(tree)
    self.indices = [i for i, w in enumerate(jax.tree.leaves(wanted)) if w]

  def trained(self, leaves=None) -> list:
    leaves = self.leaves if leaves is None else leaves
    return [leaves[i] for i in self.indices]

  def with_trained(self, trained: list, leaves=None):
    leaves = list(self.leaves if leaves is None else leaves)
    for i, w in zip(self.indices, trained):
      leaves[i] = w
    return jax.tree.unflatten(self.treedef, leaves)

  def gradients(self, grads: list):
    """The tree of `grads` (one per trained leaf), None at the others."""
    full = [None] * len(self.leaves)
    for i, g in zip(self.indices, grads):
      full[i] = g
    return jax.tree.unflatten(self.treedef, full)


@dataclasses.dataclass
class _Loop:
  """What every tick of one step's 1F1B loop reads: the schedule, the blocks' layer function, the
  stages' weights and dropout keys, the microbatches' inputs and targets, where gradients go, and
  the loss's cotangent (`seed`). Its methods are the loop's parts, in the order a tick runs them."""
  schedule: PipelineSchedule
  layer: Any                  # one block: layer(weights, x, key, rows) (models/llama.py)
  layers: _Trained            # the stacked blocks' weights
  embed_weights: _Trained
  tail_weights: _Trained
  stage_leaves: list          # the stacked weights' leaves, [stages, repeats, chunk, ...] each
  stage_keys: Any             # dropout keys the same way, or None
  stage_valid: Any            # [stages, repeats, chunk] bool: the slots that run a layer, or None
  micro_rows: Any             # per-row inputs of the blocks, [microbatches, rows, ...]
  micro_embed_rows: Any       # what the embedding reads, the same way
  micro_targets: Any
  embed: Any                  # embed(weights, rows) -> one microbatch's first block input
  tail: Any                   # tail(weights, hidden, targets, microbatch) -> its loss sum
  place_grads: list           # per (layers, embedding, tail): a placement per trained leaf
  seed: jax.Array             # the cotangent the loss sum will get
  rolled_backward: bool
  embed_after: bool = False   # the embedding's gradient formed after the loop (`embeds_after`)

  def pick(self, a, index):
    """One chunk of a stage's [repeats, chunk, ...]."""
    return a[0] if self.schedule.repeats == 1 else at(a, index)

  def chunk_of(self, weight_leaves, stage_keys, valid, index, microbatch):
    """(the chunk's weights, its dropout keys, its microbatch's per-row inputs, its slots that run
    a layer)."""
    picked = [self.pick(a, index) for a in weight_leaves]
    chunk_keys = None
    if stage_keys is not None:   # a dropout mask per layer and microbatch
      chunk_keys = jax.vmap(lambda k: jax.random.fold_in(k, microbatch))(
          self.pick(stage_keys, index))
    valid = None if valid is None else self.pick(valid, index)
    return picked, chunk_keys, _take(self.micro_rows, microbatch), valid

  def chunk_forward(self, weight_leaves, stage_keys, valid, index, microbatch, held):
    picked, chunk_keys, rows_now, valid = self.chunk_of(weight_leaves, stage_keys, valid, index,
                                                        microbatch)
    return scan_chunk(self.layer, jax.tree.unflatten(self.layers.treedef, picked), held,
                      chunk_keys, rows_now, unroll=True, valid=valid)

  def chunk_backward(self, weight_leaves, stage_keys, valid, index, microbatch, held, cotangent):
    """(the gradients of the chunk's trained weights, [chunk, ...] each; of its input)."""
    picked, chunk_keys, rows_now, valid = self.chunk_of(weight_leaves, stage_keys, valid, index,
                                                        microbatch)

    def apply(trained, held):
      return scan_chunk(self.layer, self.layers.with_trained(trained, picked), held, chunk_keys,
                        rows_now, unroll=not self.rolled_backward, valid=valid)
    return jax.vjp(apply, self.layers.trained(picked), held)[1](cotangent)

  def embed_of(self, microbatch):
    rows_now = _take(self.micro_embed_rows, microbatch)
    return lambda trained: self.embed(self.embed_weights.with_trained(trained), rows_now)

  def tail_of(self, microbatch):
    targets_now = at(self.micro_targets, microbatch)
    return lambda trained, y: self.tail(self.tail_weights.with_trained(trained), y, targets_now,
                                        microbatch)

  def forward_slot(self, weight_leaves, stage_keys, valid, staged, t, first):
    """One stage's forward slot: the first stage takes the item's embedded microbatch (`first`,
    made once for all stages), the chunk's input is kept for its backward slot, and the chunk
    runs. Returns (the stage's carry, its output)."""
    staged = dict(staged)
    held = jnp.where(t['f_first'], first.astype(staged['forward_in'].dtype), staged['forward_in'])
    kept = staged['kept']
    staged['kept'] = jax.lax.dynamic_update_index_in_dim(
        kept, jnp.where(t['f_valid'], held, at(kept, t['f_slot'])), t['f_slot'], 0)
    return staged, self.chunk_forward(weight_leaves, stage_keys, valid, t['f_chunk'],
                                      t['f_micro'], held)

  def loss_slot(self, carry, t, out):
    """An item leaving its last chunk on the last stage: its loss, the head's gradient summed,
    and the gradient of the chunk's output, which its backward starts from there in the same tick
    (zeros where no item leaves). Outside the stages' vmap, so that the head's product is split
    over the vocabulary's devices (`stage` among them), not repeated on each stage; skipped in the
    ticks where no item leaves (interleaved: R - 1 in R)."""
    def head(loss, tail_grads):
      loss_now, tail_vjp = jax.vjp(self.tail_of(t['f_micro'][-1]), self.tail_weights.trained(),
                                   out[-1])
      d_tail, dy = tail_vjp(self.seed)
      return (loss + loss_now, _added(tail_grads, d_tail, True, self.place_grads[2]),
              dy.astype(out.dtype))
    carry['loss'], carry['tail_grads'], head_dy = jax.lax.cond(
        t['f_last'][-1], head, lambda loss, grads: (loss, grads, jnp.zeros_like(out[-1])),
        carry['loss'], carry['tail_grads'])
    return head_dy

  def backward_slot(self, weight_leaves, stage_keys, valid, staged, t, head_dy):
    """One stage's backward slot: the chunk's vjp from its kept input and the gradient of its
    output (on the last stage, for an item leaving it, the head's `head_dy`); its weights'
    gradient added to its chunk's sum. Returns (the stage's carry, the gradient of the chunk's
    input)."""
    cotangent = jnp.where(t['b_first'], head_dy.astype(staged['backward_in'].dtype),
                          staged['backward_in'])
    d_weights, dx = self.chunk_backward(weight_leaves, stage_keys, valid, t['b_chunk'],
                                        t['b_micro'], at(staged['kept'], t['b_slot']), cotangent)
    grads = []
    for g, d, place in zip(staged['grads'], d_weights, self.place_grads[0]):
      d = jnp.where(t['b_valid'], d, 0).astype(g.dtype)
      grads.append(place(g + d[None] if self.schedule.repeats == 1 else
                         jax.lax.dynamic_update_index_in_dim(g, at(g, t['b_chunk']) + d, t['b_chunk'],
                                                             0)))
    return {**staged, 'grads': grads}, dx

  def embedding_slot(self, carry, t, dx):
    """An item's backward leaving the first chunk on the first stage: the embedding's gradient
    added to its sum, or (`embed_after`) the gradient of the embedding's output kept for it."""
    if not self.embed_weights.indices:
      return
    last, m = t['b_last'][0], t['b_micro'][0]
    if self.embed_after:
      kept = carry['embedded_grads']
      carry['embedded_grads'] = jax.lax.dynamic_update_index_in_dim(
          kept, jnp.where(last, dx[0].astype(kept.dtype), kept[m]), m, 0)
      return
    embed_vjp = lambda: jax.vjp(self.embed_of(m), self.embed_weights.trained())[1]
    carry['embed_grads'] = jax.lax.cond(
        last, lambda g: _added(g, embed_vjp()(dx[0])[0], True, self.place_grads[1]),
        lambda g: g, carry['embed_grads'])

  def phase(self, forward, backward, carry, tables):
    """The ticks of `tables`: every stage's forward slot at once (a vmap laid on `stage`), the
    embedding and the head where an item enters and leaves, every stage's backward slot."""
    mapped = lambda a: None if a is None else 0
    stage_axes = (0, mapped(self.stage_keys), mapped(self.stage_valid), 0, 0)
    forwards = jax.vmap(self.forward_slot, in_axes=stage_axes + (None,),
                        spmd_axis_name=STAGE_AXIS)
    backwards = jax.vmap(self.backward_slot, in_axes=stage_axes + (None,),
                         spmd_axis_name=STAGE_AXIS)
    weights = (self.stage_leaves, self.stage_keys, self.stage_valid)

    def tick(carry, t):
      carry = dict(carry)
      staged = carry['staged']
      out = staged['forward_in']
      if forward:
        first = self.embed_of(t['f_micro'][0])(self.embed_weights.trained())
        staged, out = forwards(*weights, staged, t, first)
      dx = staged['backward_in']
      if backward:   # (in the backward-only ticks no item leaves the last stage)
        head_dy = (self.loss_slot(carry, t, out) if forward else
                   jnp.zeros(dx.shape[1:], dx.dtype))
        staged, dx = backwards(*weights, staged, t, head_dy)
        self.embedding_slot(carry, t, dx)
      # Every forward output one stage on, every backward one one stage back (round the ring).
      carry['staged'] = {**staged, 'forward_in': jnp.roll(out, 1, axis=0),
                         'backward_in': jnp.roll(dx, -1, axis=0)}
      return carry, None
    return jax.lax.scan(tick, carry, tables)[0]

  def first_carry(self) -> dict:
    """The loop's state before its first tick: nothing in flight, every sum zero. `staged`: what
    each stage holds, [stages, ...]; the rest is the step's, placed as its gradients are."""
    stages = self.schedule.stages
    shape = jax.eval_shape(self.embed_of(0), self.embed_weights.trained())
    activation = jnp.zeros((stages,) + shape.shape, shape.dtype)
    zeros = lambda shapes, places: [place(jnp.zeros(a.shape, a.dtype))
                                    for a, place in zip(shapes, places)]
    return {
        'staged': {
            'forward_in': activation, 'backward_in': activation,
            'kept': jnp.zeros((stages, self.schedule.in_flight) + shape.shape, shape.dtype),
            'grads': [_in_stages(place)(jnp.zeros((stages,) + a[0].shape, a.dtype))
                      for a, place in zip(self.layers.trained(self.stage_leaves),
                                          self.place_grads[0])]},
        'embed_grads': ([] if self.embed_after else
                        zeros(self.embed_weights.trained(), self.place_grads[1])),
        'embedded_grads': (jnp.zeros((self.schedule.microbatches,) + shape.shape, shape.dtype)
                           if self.embed_after else None),
        'tail_grads': zeros(self.tail_weights.trained(), self.place_grads[2]),
        'loss': jnp.zeros((), jnp.float32),
    }


def _take(tree, microbatch):
  return jax.tree.map(lambda a: at(a, microbatch), tree)


def _in_stages(place):
  return jax.vmap(place, spmd_axis_name=STAGE_AXIS)


def _added(totals, grads, keep, places):
  """Each running sum plus its gradient where `keep`, placed."""
  return [place(g + jnp.where(keep, d, 0).astype(g.dtype))
          for g, d, place in zip(totals, grads, places)]


def _run(schedule: PipelineSchedule, placements, rolled_backward, layer, keys, rows, embed,
         embed_rows, tail, targets, seed, weights, wanted):
  """(loss sum, gradients of `weights` = (layers, embedding's, tail's): None where `wanted` is
  False); `wanted` None: the loss alone. `placements`: OneFOneB._placements."""
  if wanted is None:
    wanted = jax.tree.map(lambda _: False, weights)
  weights = placed_vocabulary(weights, placements)
  layers, embed_weights, tail_weights = (_Trained(w, want) for w, want in zip(weights, wanted))
  layer_split = schedule.layer_split(layers.leaves[0].shape[0])
  split = lambda tree: jax.tree.map(lambda a: split_rows(jnp.asarray(a), schedule.microbatches),
                                    tree)
  loop = _Loop(
      schedule, layer, layers, embed_weights, tail_weights,
      # [stages, repeats, chunk, ...]: chunk r * stages + p of the model on stage p, placed once
      # per step.
      stage_leaves=[_in_stages(place)(on_stages(layer_split.take(a)))
                    for a, place in zip(layers.leaves, jax.tree.leaves(placements[0]))],
      stage_keys=None if keys is None else layer_split.take(keys),
      stage_valid=layer_split.valid(),
      micro_rows=split(rows), micro_embed_rows=split(embed_rows), micro_targets=split(targets),
      embed=embed, tail=tail,
      place_grads=[_Trained(p, want).trained() for p, want in zip(placements[1], wanted)],
      seed=seed, rolled_backward=rolled_backward,
      embed_after=embeds_after(schedule, embed, embed_weights, split(embed_rows)))

  carry = loop.first_carry()
  tables = {k: jnp.asarray(v) for k, v in schedule.ticks().items()}
  first_backward, after_forwards = schedule.phases
  cut = lambda start, stop: jax.tree.map(lambda a: a[start:stop], tables)
  carry = loop.phase(True, False, carry, cut(0, first_backward))
  carry = loop.phase(True, True, carry, cut(first_backward, after_forwards))
  carry = loop.phase(False, True, carry, cut(after_forwards, schedule.iterations))

  return carry['loss'], (
      layers.gradients([layer_split.put_back(g) for g in carry['staged']['grads']]),
      embed_weights.gradients(embedding_grads(embed, embed_weights, embed_rows,
                                              carry['embedded_grads'], loop.place_grads[1])
                              if loop.embed_after else carry['embed_grads']),
      tail_weights.gradients(carry['tail_grads']))


def placed_vocabulary(weights, placements):
  """(layers, embedding, tail) weights with the embedding's and tail's placed for the loop."""
  placed = lambda tree, places: jax.tree.map(lambda a, place: place(a), tree, places)
  return weights[0], placed(weights[1], placements[2]), placed(weights[2], placements[3])


def embeds_after(schedule: PipelineSchedule, embed, embed_weights: _Trained,
                 micro_embed_rows) -> bool:
  """Whether the embedding's gradient is formed once after the loop, from its outputs' gradients
  kept per microbatch, rather than summed at every tick: where those take fewer bytes than the
  gradient's fp32 sum, which at every tick is a [vocabulary, d_model] scatter and a reduction over
  the data-parallel devices. The outputs' gradients are counted for the whole batch, all the
  data-parallel devices' together (one device keeps its share), so the choice errs towards the
  sum. (1b, a 128k vocabulary, batch 16 x 512 tokens: 32 MiB of outputs' gradients against a
  1 GiB table; 7b, a 32k vocabulary, batch 64 x 4096: 2 GiB against 0.49 GiB.)"""
  if not embed_weights.indices:
    return False
  output = jax.eval_shape(embed, jax.tree.unflatten(embed_weights.treedef, embed_weights.leaves),
                          _take(micro_embed_rows, 0))
  kept = schedule.microbatches * output.size * output.dtype.itemsize
  table = sum(a.size * 4 for a in embed_weights.trained())
  return kept < table


def embedding_grads(embed, embed_weights: _Trained, embed_rows, embedded_grads, places) -> list:
  """The embedding's trained weights' gradients, from the first stage's gradients of its
  microbatches' outputs (`embedded_grads` [microbatches, rows / M, ...]): one vjp of the
  embedding over the whole batch, once per step."""
  if not embed_weights.indices:
    return []
  outputs = join_rows(embedded_grads)
  _, pullback = jax.vjp(lambda w: embed(embed_weights.with_trained(w), embed_rows).astype(
      outputs.dtype), embed_weights.trained())
  return [place(g) for g, place in zip(pullback(outputs)[0], places)]
