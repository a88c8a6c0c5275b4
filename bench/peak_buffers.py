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


def read_peak(directory: str, module: str = 'jit_train_step') -> Peak:
  """The peak of the temp allocation of the newest dumped module whose name contains `module`."""
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

  starts = collections.defaultdict(list)
  for name, (start, _) in ranges.items():
    starts[start].append(name)
  live, best, best_at, best_live = set(), -1, 0, []
  for t in range(max(sequence) + 1 if sequence else 0):
    live.update(starts.get(t, ()))
    live = {n for n in live if ranges[n][1] >= t}
    occupied = _union_bytes(placed[n][:2] for n in live)
    if occupied > best:
      best, best_at, best_live = occupied, t, sorted(live)
  instruction = sequence.get(best_at, '')
  buffers = sorted((Buffer(n, placed[n][2], placed[n][1], op_names.get(n.split('{')[0], ''))
                    for n in best_live), key=lambda b: (-b.size, b.name))
  return Peak(temp_bytes, max(best, 0), instruction, op_names.get(instruction, ''), buffers)


def _union_bytes(spans) -> int:
  """Bytes covered by (offset, size) spans (values that alias one buffer count once)."""
  total, reach = 0, -1
  for start, size in sorted(spans):
    end = start + size
    if end > reach:
      total += end - max(start, reach)
      reach = end
  return total
