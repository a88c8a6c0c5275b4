"""Which of the model's layers each pipeline chunk runs: even splits and uneven ones.

The layers are cut into `stages x repeats` chunks of consecutive layers, chunk r * stages + p on
stage p (round r of the ring). `parallel.pipeline_stage_layers` gives the chunks' layer counts in
model order ('7,8,8,7': 30 layers on 4 stages). Left empty: chunks of ceil(layers / chunks), the
last ones holding what is left (30 on 4 stages: 8,8,8,6), which is how the layers are stored, so
nothing moves; where that would leave a chunk empty (28 on 8), as even as they go, the extra layers
on the middle chunks (the first and last also run the embedding and the head).

Every stage runs one program (a vmap or shard_map over `stage`), so each chunk is given the depth
of the deepest: `slots` is a [stages, repeats, depth] table of layer indices, and a chunk shorter
than the depth repeats its last layer in the slots it lacks, slots that pass their input through
unchanged (`valid` False) and so get no gradient. They cost a layer's compute each, as a stage of
the deepest chunk's depth would: the stages run in step.

The weights stay stored in model order on their [num_layers] axis, split over `stage` in
contiguous blocks of ceil(num_layers / stages) (the last blocks padded: parallel/padding.py), so
checkpoints do not depend on the split. A split that is that storage's own blocks (even, or the
last chunks shorter: `blocks`) is taken by a reshape; any other takes each chunk's layers out of it
once per step and puts their gradients back (`take`, `put_back`) stage to stage: the stored
blocks rotate a stage at a time and each slot keeps its layer as it passes (`_regroup`). A gather
there instead is left to XLA's partitioner, which gathers the whole stack onto every stage and
all-reduces its whole gradient back: at 405b on 64 stages, 51 GiB per MLP weight on every device.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class LayerSplit:
  counts: tuple[int, ...]   # layers of each chunk, in model order
  stages: int               # P
  repeats: int              # R: chunks per stage

  @classmethod
  def of(cls, num_layers: int, stages: int, repeats: int,
         counts: tuple[int, ...] = ()) -> 'LayerSplit':
    """`counts` as given; or the storage's own blocks (`blocks`) where they leave no chunk
    empty; or else as even as it goes, the remainder on the middle chunks."""
    if counts:
      return cls(tuple(counts), stages, repeats)
    chunks = stages * repeats
    blocks = _blocks(num_layers, chunks, -(-num_layers // chunks))
    if min(blocks) > 0:
      return cls(blocks, stages, repeats)
    base, extra = divmod(num_layers, chunks)
    first = (chunks - extra) // 2
    return cls(tuple(base + (first <= c < first + extra) for c in range(chunks)), stages, repeats)

  @property
  def depth(self) -> int:
    """Layer slots per chunk: the deepest chunk's count."""
    return max(self.counts)

  @property
  def blocks(self) -> bool:
    """Every chunk `depth` deep but the last ones, which hold what is left: the layers' axis
    padded at its end to chunks x depth (as its storage is, by ceil(num_layers / stages) a stage)
    and cut into chunks, so taking them moves nothing an even split would not."""
    return self.counts == _blocks(sum(self.counts), len(self.counts), self.depth)

  @property
  def stage_layers(self) -> tuple[int, ...]:
    """The layers each stage runs, over its chunks."""
    P = self.stages
    return tuple(sum(self.counts[p::P]) for p in range(P))

  def slots(self) -> tuple[np.ndarray, np.ndarray]:
    """([stages, repeats, depth] int: the model layer in each slot, the same shape bool: whether
    the slot runs it)."""
    P, R, depth = self.stages, self.repeats, self.depth
    starts = np.cumsum((0,) + self.counts[:-1])
    index = np.zeros((P, R, depth), np.int32)
    valid = np.zeros((P, R, depth), bool)
    for c, (start, count) in enumerate(zip(starts, self.counts)):
      r, p = divmod(c, P)
      index[p, r] = start + np.minimum(np.arange(depth), count - 1)
      valid[p, r] = np.arange(depth) < count
    return index, valid

  def valid(self) -> jax.Array | None:
    """[stages, repeats, depth] bool (see `slots`), or None where every slot runs its layer."""
    return None if len(set(self.counts)) == 1 else jnp.asarray(self.slots()[1])

  def take(self, a: jax.Array) -> jax.Array:
    """[num_layers, ...] in model order -> [stages, repeats, depth, ...]: each chunk's layers."""
    P, R, depth = self.stages, self.repeats, self.depth
    if not self.blocks:
      index = self.slots()[0].reshape(P, R * depth)
      taken = _regroup(self._stored_blocks(a), *divmod(index, self._stored_depth))
      return taken.reshape(P, R, depth, *a.shape[1:])
    if a.shape[0] < P * R * depth:
      a = jnp.pad(a, [(0, P * R * depth - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(R, P, depth, *a.shape[1:]).swapaxes(0, 1)

  def put_back(self, a: jax.Array) -> jax.Array:
    """`take`'s inverse for what the slots computed (their gradients): [stages, repeats, depth,
    ...] -> [num_layers, ...] in model order, the slots that do not run a layer left out."""
    layers = sum(self.counts)
    if self.blocks:
      a = a.swapaxes(0, 1)
      return a.reshape(a.shape[0] * a.shape[1] * a.shape[2], *a.shape[3:])[:layers]
    P, blocks = self.stages, self._stored_depth
    index, valid = self.slots()
    running = np.full(P * blocks, -1)   # each stored slot's layer's one running slot (a flat
                                        # index into [stages, repeats, depth]), -1 for padding
    running[index[valid]] = np.flatnonzero(valid)
    source = divmod(running.reshape(P, blocks), valid[0].size)
    put = _regroup(a.reshape(P, -1, *a.shape[3:]), *source, present=running.reshape(P, -1) >= 0)
    return put.reshape(P * blocks, *a.shape[3:])[:layers]

  @property
  def _stored_depth(self) -> int:
    """Layers a stage stores: ceil(num_layers / stages), the last stages' blocks padded."""
    return -(-sum(self.counts) // self.stages)

  def _stored_blocks(self, a: jax.Array) -> jax.Array:
    """[num_layers, ...] -> [stages, stored depth, ...], each stage's own stored block (padded at
    the end as XLA lays out an uneven split, so nothing moves)."""
    padded = self.stages * self._stored_depth
    a = jnp.pad(a, [(0, padded - a.shape[0])] + [(0, 0)] * (a.ndim - 1))
    return a.reshape(self.stages, self._stored_depth, *a.shape[1:])


def _regroup(blocks: jax.Array, stage: np.ndarray, local: np.ndarray,
             present: np.ndarray | None = None) -> jax.Array:
  """[P, n, ...] (row p on stage p) -> [P, k, ...] with row p's slot i `blocks[stage[p, i],
  local[p, i]]` (zeros where `present` is False), moved a hop at a time: the stages' blocks
  rotate one stage on (a collective permute) per iteration of a loop, and each slot takes its
  layer on the hop it arrives, so a device holds the blocks in transit and its slots however far
  a layer travels. (A rotation per distance, unrolled, kept every rotated copy alive: 80 layers on
  64 stages, 47 layers' worth a device beside the 2 taken.) `stage`, `local`, `present`: [P, k],
  static."""
  P, k = stage.shape
  present = np.ones((P, k), bool) if present is None else present
  hops = np.where(present, np.arange(P)[:, None] - stage, 0)   # > 0: from a stage before
  slots = jnp.zeros((P, k) + blocks.shape[2:], blocks.dtype)
  slots = _arrive(slots, blocks, jnp.asarray(present & (hops == 0)), local)
  for direction in (1, -1):
    far = int((direction * hops[present]).max(initial=0))
    if far == 0:
      continue
    arrivals = jnp.asarray(np.stack([present & (hops == direction * h) for h in range(1, far + 1)]))

    def hop(carry, arrive, direction=direction):
      transit, slots = carry
      transit = jnp.roll(transit, direction, axis=0)   # hop h: row p holds stage p - direction h's
      return (transit, _arrive(slots, transit, arrive, local)), None

    slots = jax.lax.scan(hop, (blocks, slots), arrivals)[0][1]
  return slots


def _arrive(slots: jax.Array, blocks: jax.Array, arrive: jax.Array, local: np.ndarray) -> jax.Array:
  """`slots` [P, k, ...] with row p's slot i set to `blocks[p, local[p, i]]` where `arrive[p, i]`:
  selects over all k slots at once, one per stored block a slot takes (each row picks its own
  block, so nothing crosses a stage; a select per slot and block made the trace k times longer)."""
  rows = lambda mask: mask.reshape(*mask.shape, *(1,) * (blocks.ndim - 2))
  picked = jnp.broadcast_to(blocks[:, :1], slots.shape)
  for j in range(1, blocks.shape[1]):
    if (local == j).any():
      picked = jnp.where(rows(jnp.asarray(local == j)), blocks[:, j:j + 1], picked)
  return jnp.where(rows(arrive), picked, slots)


def _blocks(num_layers: int, chunks: int, depth: int) -> tuple[int, ...]:
  """The layers of each chunk where the stack, padded to chunks x depth, is cut into chunks."""
  return tuple(min(depth, max(0, num_layers - c * depth)) for c in range(chunks))


def parse(text: str) -> tuple[int, ...] | None:
  """'7,8,8,7' -> (7, 8, 8, 7); '' -> (); None where `text` is not a list of integers."""
  text = str(text).strip().strip('()[]')
  if not text:
    return ()
  try:
    return tuple(int(part) for part in text.split(','))
  except ValueError:
    return None


def refusal(text: str, num_layers: int, stages: int, repeats: int) -> str | None:
  """One line naming what in `parallel.pipeline_stage_layers` does not fit, or None."""
  chunks = stages * repeats
  counts = parse(text)
  name = f'parallel.pipeline_stage_layers={text!r}'
  if counts is None:
    return f'{name}; give the layers of each chunk as integers, e.g. 7,8,8,7 (or leave it empty)'
  if not counts:
    if num_layers < chunks:
      return (f'model.num_layers={num_layers} cannot give each of mesh.stage={stages} x '
              f'parallel.pipeline_repeats={repeats} = {chunks} chunks a layer; use at most '
              f'{num_layers} chunks')
    return None
  if len(counts) != chunks:
    return (f'{name} names {len(counts)} chunks; mesh.stage={stages} x parallel.pipeline_repeats='
            f'{repeats} makes {chunks} (one count per chunk, in model order)')
  if min(counts) < 1:
    return f'{name}: each chunk needs at least one layer'
  if sum(counts) != num_layers:
    return (f'{name} adds up to {sum(counts)} layers; model.num_layers={num_layers} (the counts '
            f'must add up to it)')
  return None
