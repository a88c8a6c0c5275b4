"""What a compiled program holds at its memory peak: the live buffers, read from XLA's dumps.

XLA's memory analysis (memory/compiled.py) gives the temp size and no more. To say which term of
the estimate is missing or wrong, compile once more with XLA's dumps on (`compile_with_dumps`), then
read three of its files for the optimized module:

- `*-buffer-assignment.txt`: every value XLA placed in the temp allocation, its offset and size;
- `*-live-range.txt`: the instruction sequence and each value's live range in it;
- `*cpu_after_optimizations.txt` (or the GPU's): each instruction's `op_name` (which part of
  the model, forward or backward, made it).

The temp occupancy at each point of the sequence is the union of the byte ranges of the values
live there; the peak is where it is largest, and the values live there are what the peak is made
of. Nothing is allocated: this works on the dry run's simulated devices, at any model size.
"""
import collections
import dataclasses
import glob
import os
import re

from parallel import collectives

_ALLOCATION = re.compile(r'^allocation (\d+): size (\d+)(.*):\s*$')
_VALUE = re.compile(r'^ value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$')
_LIVE = re.compile(r'^\s+(\S+):(\d+)-(\d+)\s*$')
_SEQUENCE = re.compile(r'^\s+(\d+):(\S+)\s*$')
_OP_NAME = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Buffer:
  name: str        # the value: an instruction's name, with a tuple index where it has one
  shape: str
  size: int        # bytes
  op_name: str     # the JAX operation that made it (its name scopes: mlp, attention, transpose(...))


@dataclasses.dataclass(frozen=True)
class Peak:
  temp_bytes: int          # the temp allocation's size (memory analysis' `temp`)
  peak_bytes: int          # the largest occupancy of it at one point of the sequence
  at: str                  # the instruction running there
  at_op_name: str
  live: list[Buffer]       # the values live there, largest first


def compile_with_dumps(lowered, directory: str):
  """`lowered.compile()` with XLA's text dumps written to `directory` (debug options of this
  compile only: other compiles are unaffected; never served from the persistent cache)."""
  return collectives.compile_with_dumps(lowered, {'xla_dump_to': directory})


def _normalise(name: str) -> str:
  """A live-range name (`x{}`, `t{1}`) as the buffer assignment writes it (`x`, `t{1}`)."""
  return name[:-2] if name.endswith('{}') else name


def _newest(directory: str, pattern: str, module: str) -> str:
  files = [f for f in glob.glob(os.path.join(directory, f'*{module}*{pattern}'))]
  if not files:
    raise FileNotFoundError(f'no XLA dump matching *{module}*{pattern} in {directory}')
  return max(files, key=lambda f: (os.path.getmtime(f), f))


@dataclasses.dataclass(frozen=True)
class _Dumps:
  """What the three dump files say of the temp allocation."""
  temp_bytes: int
  placed: dict      # value -> (offset, size, shape) in the temp allocation
  sequence: dict    # position -> instruction
  ranges: dict      # value -> (first, last) position it is live
  op_names: dict    # instruction -> op_name


def _read_dumps(directory: str, module: str) -> _Dumps:
  assignment = _newest(directory, 'after_optimizations-buffer-assignment.txt', module)
  prefix = assignment[:-len('-buffer-assignment.txt')]
  with open(assignment) as f:
    lines = f.read().splitlines()
  temp_bytes, placed, in_temp = 0, {}, False
  for line in lines:
    allocation = _ALLOCATION.match(line)
    if allocation:
      in_temp = 'preallocated-temp' in allocation.group(3)
      if in_temp:
        temp_bytes = int(allocation.group(2))
      continue
    value = _VALUE.match(line)
    if value and in_temp:
      name, size, offset, shape = value.groups()
      placed[name] = (int(offset), int(size), shape.strip())

  sequence, ranges = {}, {}
  with open(prefix + '-live-range.txt') as f:
    section = None
    for line in f:
      if 'InstructionSequence' in line:
        section = 'sequence'
      elif 'BufferLiveRange' in line:
        section = 'ranges'
      elif section == 'sequence' and (m := _SEQUENCE.match(line)):
        sequence[int(m.group(1))] = m.group(2)
      elif section == 'ranges' and (m := _LIVE.match(line)):
        name = _normalise(m.group(1))
        if name in placed:
          ranges[name] = (int(m.group(2)), int(m.group(3)))

  op_names = {}
  with open(prefix + '.txt') as f:
    for line in f:
      if (m := _OP_NAME.match(line)):
        op_names[m.group(1)] = m.group(2)
  return _Dumps(temp_bytes, placed, sequence, ranges, op_names)


def _occupancy(dumps: _Dumps):
  """(position, bytes occupied, live values) at each position of the instruction sequence."""
  starts = collections.defaultdict(list)
  for name, (start, _) in dumps.ranges.items():
    starts[start].append(name)
  live = set()
  for t in range(max(dumps.sequence) + 1 if dumps.sequence else 0):
    live.update(starts.get(t, ()))
    live = {n for n in live if dumps.ranges[n][1] >= t}
    yield t, _union_bytes(dumps.placed[n][:2] for n in live), live


def _peak_at(dumps: _Dumps, t: int, occupied: int, live) -> Peak:
  instruction = dumps.sequence.get(t, '')
  buffers = sorted((Buffer(n, dumps.placed[n][2], dumps.placed[n][1],
                           dumps.op_names.get(n.split('{')[0], '')) for n in live),
                   key=lambda b: (-b.size, b.name))
  return Peak(dumps.temp_bytes, occupied, instruction, dumps.op_names.get(instruction, ''), buffers)


def read_peak(directory: str, module: str = 'jit_train_step') -> Peak:
  """The peak of the temp allocation of the newest dumped module whose name contains `module`."""
  dumps = _read_dumps(directory, module)
  best = (0, -1, set())
  for t, occupied, live in _occupancy(dumps):
    if occupied > best[1]:
      best = (t, occupied, set(live))
  return _peak_at(dumps, best[0], max(best[1], 0), best[2])


# The train step's phases, told apart by the JAX name scopes in the running instruction's op_name
# (train/step.py, models/llama.py): the update's `optimizer` scope; the layer scan (a `while`)
# differentiated, `transpose(jvp())/while`, or forward, `jvp()/while`; the rest of the
# differentiated step (`transpose(...)`: the loss and the head), the rest of the forward (`jvp(`:
# the lookup, the final norm, the loss). The first that matches names the phase.
PHASES = (('update', '/optimizer'), ('layers backward', 'transpose(jvp())/while'),
          ('layers forward', 'jvp()/while'), ('head backward', 'transpose('),
          ('forward', 'jvp('))


def phase_of(op_name: str) -> str:
  """The step's phase an instruction with this op_name runs in (`PHASES`), else 'other'."""
  return next((phase for phase, scope in PHASES if scope in op_name), 'other')


def read_phases(directory: str, module: str = 'jit_train_step') -> dict[str, Peak]:
  """Each phase's own peak (`PHASES`): the largest occupancy of the temp allocation while one of
  its instructions runs, and the values live there. The step's peak is the largest of them; the
  others say how near each phase comes, which is what a phase of the estimate is checked against."""
  dumps = _read_dumps(directory, module)
  best = {}
  for t, occupied, live in _occupancy(dumps):
    phase = phase_of(dumps.op_names.get(dumps.sequence.get(t, ''), ''))
    if occupied > best.get(phase, (0, -1))[1]:
      best[phase] = (t, occupied, set(live))
  return {phase: _peak_at(dumps, t, occupied, live)
          for phase, (t, occupied, live) in sorted(best.items(), key=lambda kv: -kv[1][1])}


def _union_bytes(spans) -> int:
  """Bytes covered by (offset, size) spans (values that alias one buffer count once)."""
  total, reach = 0, -1
  for start, size in sorted(spans):
    end = start + size
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total
