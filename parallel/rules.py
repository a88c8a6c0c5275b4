"""Logical-axis rules: the tables that turn logical names into mesh axes.

A parallel layout is a mesh shape plus these tables; the model code never changes. The tables are
the same for every layout: an axis of size 1 shards nothing, so DDP is simply a mesh whose `fsdp`
and `tensor` axes are 1. What the ZeRO stage decides is *which table each part of the train state
uses*: replicated over `fsdp` (every data-parallel device holds it whole) or sharded over `fsdp`
(each holds 1/N).

| zero_stage | parameters | gradients | optimizer state |
|---|---|---|---|
| 0 (DDP) | replicated | replicated (all-reduce) | replicated |
| 1 | replicated | replicated (all-reduce) | sharded |
| 2 | replicated | sharded (reduce-scatter) | sharded |
| 3 (FSDP) | sharded (all-gathered where used) | sharded (reduce-scatter) | sharded |

"Sharded" is over `fsdp` x `context`: the devices that split a sequence share one copy of the
state as data-parallel devices do, and activations split their `length` over `context`.

Tensor parallelism (Megatron style) is in every table: attention heads and the MLP hidden
dimension are split over `tensor` (column-parallel in, row-parallel out), and so is the vocabulary
of the embedding and the logits. So is pipeline parallelism: the stacked blocks' `layers` axis is
split over `stage` (parallel/pipeline.py runs them), and so is the vocabulary (the embedding, the
head and the logits), which every stage shares.

The tables are flax's logical-axis rules, and flax turns them into PartitionSpecs
(`flax.linen.logical_to_mesh_axes(axes, table)`, the function the model's activation hints use
under `linen.logical_axis_rules`): the earlier rule wins, and a rule whose mesh axes the array
already uses is skipped whole (a later rule for the same name is its fallback). What flax does
not do is ours: the divisibility checks (parallel/sharding.py) and the padding of uneven shards
(parallel/padding.py).
"""
import dataclasses

ZERO_STAGES = (0, 1, 2, 3)

MODEL_PARALLEL = (
    ('layers', 'stage'),   # the stacked blocks: contiguous runs of layers per pipeline stage
    # The vocabulary's tables and logits: over `tensor` (Megatron's vocabulary parallelism) and
    # over `stage`, so that no pipeline stage stores a whole table (with its gradient and
    # optimizer state) and the head's product is split among the stages rather than repeated on
    # each (under a pipeline the embedding and head run outside the stages' own chunks).
    ('vocab', ('tensor', 'stage')),
    ('heads', 'tensor'),
    ('kv_heads', 'tensor'),
    ('mlp', 'tensor'),
)

# Context parallelism: the sequence is split over `context` (models/context.py).
SEQUENCE = (('length', 'context'),)

# Activations: the batch is split over every data-parallel axis (FSDP is data parallel too).
ACTIVATIONS = (('batch', ('data', 'fsdp')),) + SEQUENCE + MODEL_PARALLEL

# State that each data-parallel device holds whole.
REPLICATED = MODEL_PARALLEL

# State split over `fsdp` and `context` (the context axis's devices compute on one copy of the
# model, as data-parallel ones do: torchtitan shards over its dp_shard x cp mesh the same way):
# every weight has an `embed` dimension (norm scales are only that), and d_model divides evenly far
# more often than the other dimensions.
ZERO_AXES = ('fsdp', 'context')
SHARDED = (('embed', ZERO_AXES),) + MODEL_PARALLEL

# The mesh axes whose uneven splits of stored state are padded (parallel/padding.py): the ZeRO
# axes only store, so padding them costs bytes and nothing else; so does `stage`, which splits the
# stored `layers` axis (a pipeline takes each chunk's layers out of it: parallel/stage_layers.py)
# and the vocabulary (XLA splits an uneven dimension the padding's way). `tensor` splits heads and
# the MLP's hidden dimension, and a dimension it does not divide is refused.
PADDED_AXES = ZERO_AXES + ('stage',)


# Activations inside a per-device region (a vmap over the data-parallel devices): the batch there
# is already one device's rows.
PER_DEVICE_ACTIVATIONS = SEQUENCE + MODEL_PARALLEL
DATA_PARALLEL_AXES = ('data', 'fsdp')


@dataclasses.dataclass(frozen=True)
class LayoutRules:
  activations: tuple
  params: tuple
  grads: tuple
  optimizer: tuple
  per_device_activations: tuple = PER_DEVICE_ACTIVATIONS

  @property
  def grads_replicated(self) -> bool:
    """Gradients whole on every data-parallel device (DDP, ZeRO-1): they can be summed locally
    over microbatches and reduced once per step."""
    return self.grads == REPLICATED

  @property
  def gathers_new_weights(self) -> bool:
    """Weights stored whole but updated in shards (ZeRO-1, ZeRO-2): each new weight is
    all-gathered after the update."""
    return self.params == REPLICATED and self.optimizer == SHARDED


# The first ZeRO stage that shards each part of the train state (the table above). The one
# statement of it: the layouts below, the memory estimate and the planner all read it.
SHARDED_FROM = {'optimizer': 1, 'grads': 2, 'params': 3}


def zero_shards(zero_stage: int, part: str) -> bool:
  """Whether `part` ('params', 'grads' or 'optimizer') is split over the data-parallel devices
  at this ZeRO stage."""
  return zero_stage >= SHARDED_FROM[part]


def layout_rules(zero_stage: int) -> LayoutRules:
  if zero_stage not in ZERO_STAGES:
    raise ValueError(f'parallel.zero_stage={zero_stage!r}; allowed: 0 (DDP), 1 (optimizer state '
                     f'sharded), 2 (+ gradients), 3 (+ parameters, FSDP)')
  table = {part: SHARDED if zero_shards(zero_stage, part) else REPLICATED for part in SHARDED_FROM}
  return LayoutRules(activations=ACTIVATIONS, **table)


def without_axis(table, axis: str) -> tuple:
  """`table` with mesh `axis` taken out of every rule: the rules inside a region where that axis
  is manual (a shard_map over `stage`), whose arrays are one stage's."""
  kept = lambda part: tuple(a for a in mesh_axes(part) if a != axis) or None
  return tuple((name, kept(part)) for name, part in table)


def mesh_axes(part) -> tuple[str, ...]:
  """One entry of a rule or a PartitionSpec (None, an axis name, or a tuple of names) as a tuple."""
  return (part,) if isinstance(part, str) else tuple(part or ())

