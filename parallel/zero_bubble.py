"""Zero-bubble pipeline tables (ZB-H1, Qi et al., "Zero Bubble Pipeline Parallelism", 2023): which
action each stage takes at each tick once a microbatch's backward pass on a stage is split in two.

1F1B (parallel/pipeline_1f1b.py) runs a microbatch's backward on a stage as one piece. Split, it is
B, the gradient of the stage's input, which the stage before waits for, and W, the gradient of the
stage's weights, which nothing waits for. B stays on the pipeline's critical path; W can be put off
into the ticks where the stage would otherwise wait for an input or a gradient, which is where
1F1B's bubble is. Counting F, B and W as one unit of time each, 1F1B's bubble is (P - 1) x 3 units
per stage; ZB-H1's (P - 1) x 1.

The ticks run in lock step, as the other schedules' do: in a tick every stage takes one action (F,
B, W or none), then every F's output moves one stage on and every B's one stage back, so what a
stage makes at tick t is at its neighbour from tick t + 1, kept there in the item's slot until the
neighbour uses it. An item (a microbatch) holds slot m mod `slots` of a stage from the arrival of
its input (its F, on the first stage) until its W, so a stage holds at most `slots` items'
activations whatever the count of microbatches.

The table is a list schedule, made tick by tick and stage by stage; each stage takes the first of:
1. W, where more than `stages` items wait for theirs (so W's deferral, and the memory it holds,
   stays bounded);
2. B, where its gradient is there (on the last stage: its F ran, which computed the loss);
3. F, where its input is there, the stage has a slot for it and the next stage will have one when
   the output arrives;
4. W, where one waits;
and otherwise idles. With `slots` = P + 1 (1F1B holds P microbatches' inputs on its first stage)
the bubble is ZB-H1's (P - 1) units wherever the microbatches are several times the stages, and
never more than 1F1B's; the tests check every dependency and slot by running the tables.
"""
import dataclasses

import numpy as np

IDLE, FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHTS = 0, 1, 2, 3
ACTIONS = '.FBW'   # how a table prints, by action code


@dataclasses.dataclass(frozen=True)
class ZeroBubbleTables:
  """Per tick and stage, [ticks, stages] each: `action` (the codes above), `micro` (the
  microbatch it works on; 0 where idle), `slot` (that microbatch's slot on the stage), and what
  arrives at the start of the tick: `forward_arrives` (the output of the previous stage's F at the
  tick before, for microbatch `forward_micro`), `backward_arrives` (the next stage's B's output,
  for `backward_micro`)."""
  stages: int
  microbatches: int
  slots: int
  action: np.ndarray
  micro: np.ndarray
  forward_arrives: np.ndarray
  forward_micro: np.ndarray
  backward_arrives: np.ndarray
  backward_micro: np.ndarray

  @property
  def ticks(self) -> int:
    return self.action.shape[0]

  @property
  def slot(self) -> np.ndarray:
    return self.micro % self.slots

  @property
  def bubble_fraction(self) -> float:
    """Idle stage-ticks over all stage-ticks, F, B and W counting one tick each."""
    return float((self.action == IDLE).mean())

  def text(self) -> str:
    """The table, a line per tick: `F3` is the forward of microbatch 3, `.` an idle tick."""
    return '\n'.join(' '.join(f'{ACTIONS[a]}{m:<3}' if a else '.   ' for a, m in zip(acts, micros))
                     for acts, micros in zip(self.action, self.micro))


def zb_h1(stages: int, microbatches: int) -> ZeroBubbleTables:
  """ZB-H1's tables for `stages` (P) and `microbatches` (M >= P), made as the module says."""
  P, M = stages, microbatches
  if M < P:
    raise ValueError(f'microbatches={M} with {P} stages; at least {P} keeps every stage busy')
  slots = P + 1
  never = np.iinfo(np.int64).max
  done = {kind: np.full((P, M), never, np.int64) for kind in ACTIONS[1:]}   # tick of each action
  count = {kind: np.zeros(P, np.int64) for kind in ACTIONS[1:]}             # actions taken so far
  rows = []
  tick = 0
  while count['W'].min() < M:
    if tick > 4 * (M + P) * 3:
      raise AssertionError(f'no ZB-H1 table for {P} stages and {M} microbatches')   # a bug here
    row = []
    for p in range(P):
      f, b, w = count['F'][p], count['B'][p], count['W'][p]
      can_w = w < b and done['B'][p, w] < tick
      can_b = b < f and (done['F'][p, b] if p == P - 1 else done['B'][p + 1, b]) < tick
      input_there = f < M and (p == 0 or done['F'][p - 1, f] < tick)
      slot_free = f < slots or done['W'][p, f - slots] < tick
      next_free = p == P - 1 or f < slots or done['W'][p + 1, f - slots] < tick
      can_f = input_there and slot_free and next_free
      if can_w and b - w > P:
        kind = 'W'
      else:
        kind = next((k for k, ok in (('B', can_b), ('F', can_f), ('W', can_w)) if ok), None)
      row.append((kind, {'F': f, 'B': b, 'W': w}.get(kind, 0)))
    for p, (kind, m) in enumerate(row):
      if kind:
        done[kind][p, m] = tick
        count[kind][p] += 1
    rows.append(row)
    tick += 1

  code = {None: IDLE, 'F': FORWARD, 'B': BACKWARD_INPUT, 'W': BACKWARD_WEIGHTS}
  action = np.array([[code[k] for k, _ in row] for row in rows], np.int32)
  micro = np.array([[m for _, m in row] for row in rows], np.int32)
  # What arrives at tick t: the F outputs of tick t - 1 one stage on, the B outputs one stage back.
  before = np.concatenate([np.full((1, P), IDLE, np.int32), action[:-1]])
  before_micro = np.concatenate([np.zeros((1, P), np.int32), micro[:-1]])
  forward_arrives = np.zeros_like(action, bool)
  forward_arrives[:, 1:] = before[:, :-1] == FORWARD
  backward_arrives = np.zeros_like(action, bool)
  backward_arrives[:, :-1] = before[:, 1:] == BACKWARD_INPUT
  forward_micro = np.zeros_like(micro)
  forward_micro[:, 1:] = np.where(forward_arrives[:, 1:], before_micro[:, :-1], 0)
  backward_micro = np.zeros_like(micro)
  backward_micro[:, :-1] = np.where(backward_arrives[:, :-1], before_micro[:, 1:], 0)
  return ZeroBubbleTables(P, M, slots, action, micro, forward_arrives, forward_micro,
                          backward_arrives, backward_micro)
