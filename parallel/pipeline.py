"""Pipeline parallelism: the block stack split into stages over the `stage` mesh axis.

The layers are cut into `stages x repeats` chunks of consecutive layers; chunk c runs on stage
c mod stages, so each stage holds `repeats` chunks (GPipe: one contiguous chunk; circular, or
interleaved: several, and an activation goes round the ring `repeats` times). The batch is split
into `microbatches`; at every iteration each stage applies one of its chunks to the activation it
holds, then every activation moves one stage on (a roll along the stage axis, which XLA compiles to
one collective-permute). `PipelineSchedule.table` says which item (a microbatch in one round of
the ring) each stage works on at each iteration; the compiled loop reads that table, so the bubble
reported from it is the bubble of the program that runs.

Written as a vmap over stages whose mapped axis is laid on the `stage` mesh axis
(`spmd_axis_name`): each stage's program is the one block stack the model defines, and the
`data`, `fsdp` and `tensor` axes keep working inside a stage exactly as without a pipeline. The
backward pass is the autodiff of the loop: all forwards, then all backwards (GPipe's order).
The embedding and the head are shared among the stages: their tables are split over `stage` by
the vocabulary (as over `tensor`; parallel/rules.py), and they run on the whole batch outside the
pipeline, each stage looking up and projecting onto its share of the vocabulary (1b on 4 stages x
2-way ZeRO-3, XLA:CPU: 4.5 GiB per device against 9.9 with the tables whole on every stage).

The weights stay stored in model order on a `[num_layers]` axis (checkpoints do not depend on the
layout); that axis is split over `stage` in contiguous blocks, which is GPipe's placement. The
circular schedule needs chunk c on stage c mod stages, so it re-lays the stacked weights out once
per step (an all-to-all of each stage's weights, and of their gradients in the backward); so does
a split of the layers other than the storage's blocks (parallel/stage_layers.py: any layer count
on any stage count).
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen, nnx
from flax.linen import logical_to_mesh_axes
from jax.sharding import PartitionSpec

from parallel.rules import REPLICATED
from parallel.sharding import logical_axes
from parallel.stage_layers import LayerSplit
from parallel.zero_bubble import ZeroBubbleTables, zb_h1

STAGE_AXIS = 'stage'
SCHEDULES = ('gpipe', 'circular', '1f1b', 'interleaved_1f1b', 'zb_h1')
# The schedules that run the backward pass inside the pipeline's loop (parallel/pipeline_1f1b.py,
# parallel/pipeline_zb.py): a microbatch's backward starts as soon as its forward has left the
# last stage.
BACKWARD_IN_LOOP = ('1f1b', 'interleaved_1f1b', 'zb_h1')


@dataclasses.dataclass(frozen=True)
class PipelineSchedule:
  name: str           # gpipe | circular | 1f1b | interleaved_1f1b | zb_h1
  stages: int         # P: the `stage` mesh axis
  microbatches: int   # M: per step (per gradient-accumulation microbatch)
  repeats: int = 1    # R: chunks per stage (1 for gpipe and 1f1b)
  chunk_layers: tuple[int, ...] = ()   # layers per chunk in model order; (): the default split

  def layer_split(self, num_layers: int) -> LayerSplit:
    """Which layers each chunk runs (parallel/stage_layers.py)."""
    return LayerSplit.of(num_layers, self.stages, self.repeats, self.chunk_layers)

  @property
  def backward_in_loop(self) -> bool:
    return self.name in BACKWARD_IN_LOOP

  @functools.cached_property
  def zero_bubble(self) -> ZeroBubbleTables | None:
    """zb_h1: its tick tables (parallel/zero_bubble.py); None for the other schedules."""
    return zb_h1(self.stages, self.microbatches) if self.name == 'zb_h1' else None

  @property
  def forward_schedule(self) -> 'PipelineSchedule':
    """The forward-only schedule with the same placement of chunks (gpipe's for 1f1b, circular's
    for interleaved_1f1b): what evaluation runs, where nothing goes backward."""
    if not self.backward_in_loop:
      return self
    return dataclasses.replace(self, name='gpipe' if self.repeats == 1 else 'circular')

  @property
  def items(self) -> int:
    """What enters the pipe per step: every microbatch once per round of the ring."""
    return self.microbatches * self.repeats

  @property
  def iterations(self) -> int:
    """Iterations of the compiled loop: forward ones (gpipe, circular), or ticks that each run a
    forward and a backward slot (1f1b: parallel/pipeline_1f1b.py), or one action per stage
    (zb_h1)."""
    if self.zero_bubble:
      return self.zero_bubble.ticks
    if self.backward_in_loop:
      return self.repeats * self.stages + self.items + self.stages - 2
    return self.items + self.stages - 1

  @property
  def in_flight(self) -> int:
    """1f1b: the stage inputs a stage keeps for its backward at most (the first stage's, from an
    item's forward to its backward), whatever the count of microbatches; zb_h1: the microbatches
    whose residuals a stage keeps at most (its slots)."""
    if self.zero_bubble:
      return self.zero_bubble.slots
    return min(2 * self.repeats * self.stages - 1, self.items)

  def ticks(self) -> dict[str, np.ndarray]:
    """1f1b: per tick and stage, [iterations, stages] each, what the stage does.

    Items (a microbatch in one round of the ring) go in groups of P microbatches: group g, round r,
    k-th of the group is item g R P + r P + k of microbatch g P + k (with R = 1 simply item m for
    microbatch m). Item i's forward runs on stage p at tick i + p; its backward, from the last chunk
    down, is backward item j = g R P + (R - 1 - r) P + k, on stage p at tick
    T0 + j + P - 1 - p with T0 = R P - 1: on the last stage in the very tick its last chunk's
    forward ends there. Every input arrives one tick before it is used: from the stage before (or,
    for the next round, from the last stage round the ring) going forward, from the stage after
    (or the first stage, round the ring) going back.

    `f_valid`, `b_valid`: the slot works (not the bubble); `f_micro`, `b_micro`: the microbatch;
    `f_chunk`, `b_chunk`: its chunk among the stage's R; `f_slot`, `b_slot`: where the stage input
    is kept for the backward (`in_flight` slots, reused round robin); `f_first`: the input is the
    embedding's output; `f_last`: the output goes to the head and loss; `b_first`: the incoming
    gradient is the loss's; `b_last`: the outgoing one is the embedding output's."""
    P, M, R = self.stages, self.microbatches, self.repeats
    items, slots = M * R, self.in_flight
    tick = np.arange(self.iterations)[:, None]
    stage = np.arange(P)[None, :]

    def decode(index):
      valid = (index >= 0) & (index < items)
      index = np.clip(index, 0, items - 1)
      group, rnd, k = index // (R * P), (index // P) % R, index % P
      return valid, group, rnd, k

    f_valid, g, r, k = decode(tick - stage)
    f_slot = (g * R * P + r * P + k) % slots
    f = dict(f_valid=f_valid, f_micro=g * P + k, f_chunk=r, f_slot=f_slot,
             f_first=f_valid & (stage == 0) & (r == 0),
             f_last=f_valid & (stage == P - 1) & (r == R - 1))
    b_valid, g, backwards_round, k = decode(tick - (R * P - 1) - (P - 1 - stage))
    r = R - 1 - backwards_round
    b = dict(b_valid=b_valid, b_micro=g * P + k, b_chunk=r, b_slot=(g * R * P + r * P + k) % slots,
             b_first=b_valid & (stage == P - 1) & (r == R - 1),
             b_last=b_valid & (stage == 0) & (r == 0))
    dtype = lambda v: bool if v.dtype == bool else np.int32
    return {k: np.broadcast_to(v, (self.iterations, P)).astype(dtype(v))
            for k, v in {**f, **b}.items()}

  @property
  def phases(self) -> tuple[int, int]:
    """1f1b: the ticks before any backward (forward only) and from which no forward runs
    (backward only); between them both run."""
    return self.repeats * self.stages - 1, self.items + self.stages - 1

  def table(self) -> np.ndarray:
    """[iterations, stages] int: the item (round r, microbatch m numbered r * M + m) that each
    stage works on at each iteration, -1 where it idles (the bubble). Item i enters stage 0 at
    iteration i and reaches stage p at iteration i + p."""
    item = np.arange(self.iterations)[:, None] - np.arange(self.stages)[None, :]
    return np.where((item >= 0) & (item < self.items), item, -1)

  @property
  def bubble_fraction(self) -> float:
    """Idle stage-iterations over all stage-iterations of the table (1f1b: idle forward and
    backward slots over all the slots its ticks run: the forward ones before the last forward,
    the backward ones from the first backward on)."""
    if not self.backward_in_loop:
      return float((self.table() < 0).mean())
    if self.zero_bubble:
      return self.zero_bubble.bubble_fraction
    ticks, (first_backward, after_forwards) = self.ticks(), self.phases
    slots = np.concatenate([ticks['f_valid'][:after_forwards], ticks['b_valid'][first_backward:]])
    return float(1 - slots.mean())

  @property
  def final_slot(self) -> int:
    """The ring slot (see `pipelined`) where the last item's output is filed."""
    return self.microbatches + (self.items - 1) % self.microbatches

  def moves(self) -> dict[str, np.ndarray]:
    """Per iteration and stage, [iterations, stages] int32 each: the ring slot the held activation
    is written to (`write`) and the slot taken to work on (`read`), the chunk index among the
    stage's `repeats` (`chunk`), and the microbatch of the item the stage works on
    (`microbatch`: its dropout keys and its per-row inputs; 0 where the stage idles).

    Ring slots (per stage): 0..M-1 the batch's microbatches, M..2M-1 the last stage's outputs,
    2M spare. Stage 0 files what arrived from the last stage (its output of the iteration before)
    at M + its microbatch, and reads item i's input: microbatch m of the batch in round 0, the
    output of round r - 1 after (there by then, since M >= P). Every other write and read is the
    spare slot, so a stage that takes nothing keeps what it holds."""
    M, P = self.microbatches, self.stages
    table = self.table()
    spare = 2 * M
    arrived = np.concatenate([[-1], table[:-1, P - 1]])   # at stage 0, from the last stage
    write = np.full(table.shape, spare)
    write[:, 0] = np.where(arrived >= 0, M + arrived % M, spare)
    item = np.maximum(table, 0)
    read = np.full(table.shape, spare)
    read[:, 0] = np.where(table[:, 0] >= 0, np.where(item[:, 0] < M, item[:, 0], M + item[:, 0] % M),
                          spare)
    chunk = np.minimum(item // M, self.repeats - 1)
    return {k: v.astype(np.int32) for k, v in
            dict(write=write, read=read, chunk=chunk, microbatch=item % M).items()}

  def report(self, num_layers: int, collectives: dict) -> dict:
    """memory.json's `pipeline` block: the schedule, its bubble (from the table the compiled loop
    reads, beside GPipe's formula (P - 1) / (M R + P - 1)) and the step's collective-permutes
    (`collectives`: parallel.collectives.collective_stats of the compiled step)."""
    P, M, R = self.stages, self.microbatches, self.repeats
    split = self.layer_split(num_layers)
    return {
        'schedule': self.name, 'stages': P, 'repeats': R, 'microbatches': M,
        'layers_per_stage': list(split.stage_layers), 'chunk_layers': list(split.counts),
        'iterations': self.iterations,
        'bubble_fraction': self.bubble_fraction,
        'bubble_formula': (P - 1) / (M * R + P - 1),
        # Every stage runs the same program: under gpipe and circular each keeps the activations
        # of all its iterations for the backward pass (the first stage's M in-flight microbatches,
        # and the bubble's; circular keeps only each iteration's input and recomputes its chunk);
        # under 1f1b each keeps the inputs of the items between their forward and backward.
        'saved_iterations_per_stage': self.in_flight if self.backward_in_loop else self.iterations,
        'collective_permute': collectives['collective-permute'],
    }

  def refusal(self, num_layers: int, rows_per_device: int) -> str | None:
    """One line naming the setting that does not fit, or None. `rows_per_device`: the rows of a
    gradient-accumulation microbatch on one data-parallel device (what the pipeline splits)."""
    P, M, R = self.stages, self.microbatches, self.repeats
    if self.name not in SCHEDULES:
      return f'parallel.pipeline_schedule={self.name!r}; allowed: {", ".join(SCHEDULES)}'
    if (not isinstance(R, int) or R < 1 or (self.name in ('gpipe', '1f1b', 'zb_h1') and R != 1)
        or (self.name == 'interleaved_1f1b' and R < 2)):
      return (f'parallel.pipeline_repeats={R!r} with parallel.pipeline_schedule={self.name!r}; '
              f'gpipe, 1f1b and zb_h1 hold one chunk per stage (repeats=1), circular takes an '
              f'integer >= 1, interleaved_1f1b one >= 2')
    if not isinstance(M, int) or M < P:
      return (f'parallel.pipeline_microbatches={M!r} with mesh.stage={P}; at least {P} (one per '
              f'stage) keeps every stage busy outside the bubble')
    if self.name == 'interleaved_1f1b' and M % P:
      return (f'parallel.pipeline_microbatches={M} with mesh.stage={P} and '
              f'parallel.pipeline_schedule=interleaved_1f1b; it runs the microbatches in groups '
              f'of {P} (one per stage), so use a multiple of {P}')
    if rows_per_device % M:
      return (f'parallel.pipeline_microbatches={M} does not divide the {rows_per_device} rows each '
              f'data-parallel device runs per gradient-accumulation microbatch; use a divisor of '
              f'{rows_per_device}')
    return None


def pipelined(schedule: PipelineSchedule, gather_once: bool = False):
  """A `models.llama.Stack` that runs the block stack through `schedule` on the `stage` axis.

  Each stage keeps a ring of activation slots: the M microbatches of the batch, the M outputs of
  the last stage (which stage 0 files as they arrive: the next round's inputs, and after the last
  round the pipeline's output), and a spare slot. Every iteration each stage writes the activation
  it holds into one slot and reads one back (`PipelineSchedule.moves`): all the schedule's choices
  are integer indices, so the backward pass keeps no masks.

  Weight gradients are summed over the loop's iterations. Sharded over `fsdp` (ZeRO-2/3), each
  iteration's is reduced into the sharded sum as it is produced (as ZeRO-2/3 do per microbatch);
  replicated (DDP, ZeRO-1), they are summed per device and reduced once (train/step.py).

  Per-row inputs (`rows`: packed rows' segment ids and rotary tables) are split into microbatches
  like the batch; each stage reads those of the microbatch it works on. They are inputs, not
  activations: nothing of them moves between stages.

  `gather_once` (ZeRO-3, `parallel.pipeline_gather_once`): each stage's weights are gathered whole
  over `fsdp` once per step, before the loop, as 1F1B's are, instead of inside it at every
  iteration, and held whole through the step. (Their gradients are left to XLA: the compiled
  memory grows by the weights alone, so the gradient sum stays in shards.)"""
  P, M, R = schedule.stages, schedule.microbatches, schedule.repeats
  moves = {k: jnp.asarray(v) for k, v in schedule.moves().items()}

  def stack(layer, layers, x, keys, rows=None):
    split = schedule.layer_split(jax.tree.leaves(layers)[0].shape[0])

    leaves, tree = jax.tree.flatten(layers)
    places = whole_on_stages(layers) if gather_once else [on_stages] * len(leaves)
    stage_layers = tree.unflatten([place(split.take(a))
                                   for a, place in zip(leaves, places, strict=True)])
    stage_keys = None if keys is None else split.take(keys)
    stage_valid = split.valid()   # None: every chunk as deep as the others
    if R == 1:   # one chunk per stage: the loop reads loop-invariant weights, nothing is picked
      stage_layers, stage_keys, stage_valid = jax.tree.map(
          lambda a: a[:, 0], (stage_layers, stage_keys, stage_valid))
    micro = split_rows(x, M)   # [M, rows / M, ...]: round robin, as the devices hold them
    micro_rows = jax.tree.map(lambda a: split_rows(jnp.asarray(a), M), rows)   # read per stage
    # Every stage has its own ring with its own copy of the batch (each device held the batch
    # already), so that the batch's gradient is summed per stage and reduced over the stages
    # once, after the loop.
    ring = jnp.concatenate([micro, jnp.zeros((M + 1,) + micro.shape[1:], micro.dtype)])
    ring = jnp.broadcast_to(ring, (P,) + ring.shape)

    def run_chunk(weights, keys, valid, held, chunk_index, microbatch):
      """The chunk of layers the item is at (one of the stage's `repeats`)."""
      if R > 1:
        weights, keys, valid = jax.tree.map(lambda w: at(w, chunk_index), (weights, keys, valid))
      if keys is not None:   # a dropout mask per layer and microbatch
        keys = jax.vmap(lambda k: jax.random.fold_in(k, microbatch))(keys)
      rows = jax.tree.map(lambda a: at(a, microbatch), micro_rows)
      return scan_chunk(layer, weights, held, keys, rows, valid=valid)

    if R > 1:
      # The chunk's weights are picked per iteration; the backward pass would keep that pick,
      # a copy of a chunk's weights per iteration. Recomputing the chunk's forward instead keeps
      # only its input (one more forward pass of the layers).
      run_chunk = jax.checkpoint(run_chunk, policy=jax.checkpoint_policies.nothing_saveable,
                                 prevent_cse=False)

    def stage_step(weights, keys, valid, ring, held, write, read, chunk_index, microbatch):
      """One stage at one iteration: file the activation held, take the one to work on, run it
      through the chunk of layers its item is at."""
      ring = jax.lax.dynamic_update_index_in_dim(ring, held, write, 0)
      held = at(ring, read)
      return run_chunk(weights, keys, valid, held, chunk_index, microbatch), ring

    mapped = lambda a: None if a is None else 0
    run_stages = jax.vmap(stage_step, in_axes=(0, mapped(keys), mapped(stage_valid), 0, 0, 0, 0,
                                               0, 0), spmd_axis_name=STAGE_AXIS)

    def iteration(carry, move):
      held, ring = carry
      held, ring = run_stages(stage_layers, stage_keys, stage_valid, ring, held, move['write'],
                              move['read'], move['chunk'], move['microbatch'])
      return (jnp.roll(held, 1, axis=0), ring), None   # every activation one stage on

    held = jnp.zeros((P,) + micro.shape[1:], micro.dtype)
    (held, ring), _ = jax.lax.scan(iteration, (held, ring), moves)
    # Stage 0's outputs (to every stage), with the last item's, which reached stage 0 after the
    # last iteration.
    outputs = jax.lax.dynamic_update_index_in_dim(ring[0, M:2 * M], held[0],
                                                  schedule.final_slot - M, 0)
    return join_rows(outputs)

  return stack


def on_stages(a: jax.Array) -> jax.Array:
  """`a` [P, ...] placed on the stages, once per step (for circular, a re-layout: the stored order
  is contiguous); left to itself XLA moves the weights inside the loop, at every iteration."""
  return jax.lax.with_sharding_constraint(
      a, PartitionSpec(STAGE_AXIS, *(PartitionSpec.UNCONSTRAINED,) * (a.ndim - 1)))


def at(a: jax.Array, index) -> jax.Array:
  """`a[index]` for a traced `index` that the schedule's tables keep in [0, len(a)) (they hold no
  negative slot, chunk or microbatch): one dynamic slice, without the compare, add and select that
  `a[index]` traces to wrap a negative index, per leaf and per read in every program's loop."""
  return jax.lax.dynamic_index_in_dim(a, index, 0, keepdims=False)


def whole_on_stages(layers) -> list:
  """Per leaf of `layers` (the stacked weights, an nnx State), what places its [P, R, chunk, ...]
  form on the stages whole over `fsdp`: its other axes (`tensor`) split as the layout splits them."""
  def place(variable):
    spec = logical_to_mesh_axes(logical_axes(variable), REPLICATED)
    return lambda a: jax.lax.with_sharding_constraint(
        a, PartitionSpec(STAGE_AXIS, None, None, *spec[1:]))
  return [place(v) for v in jax.tree.leaves(layers, is_leaf=lambda x: isinstance(x, nnx.Variable))]


def scan_chunk(layer, weights, x, keys, rows, unroll: bool = False, valid=None):
  """A chunk's layers one after another (`unroll`: as straight-line code, no loop); `valid`
  [chunk] bool: a slot where it is False passes its input through (parallel/stage_layers.py)."""
  def body(x, inputs):
    params, key, runs = inputs
    y = layer(x, params, key, rows)
    return (y if runs is None else jnp.where(runs, y, x)), None
  return jax.lax.scan(body, x, (weights, keys, valid), unroll=unroll)[0]


def split_rows(x: jax.Array, parts: int) -> jax.Array:
  """[rows, ...] -> [parts, rows / parts, ...], row i into part i mod parts: each data-parallel
  device keeps its own rows in every part."""
  split = x.reshape(x.shape[0] // parts, parts, *x.shape[1:]).swapaxes(0, 1)
  return linen.with_logical_constraint(split, (None, 'batch') + (None,) * (x.ndim - 1))


def join_rows(x: jax.Array) -> jax.Array:
  joined = x.swapaxes(0, 1).reshape(x.shape[0] * x.shape[1], *x.shape[2:])
  return linen.with_logical_constraint(joined, ('batch',) + (None,) * (x.ndim - 2))
