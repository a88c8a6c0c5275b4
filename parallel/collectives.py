"""Collectives in a compiled program: how many run per step and how many bytes they move.

Read off the optimized HLO text. An op inside a loop body (the scanned layers, the microbatch
loop) runs once per iteration, so counts are multiplied by the loops' known trip counts.

Bytes are per device and per execution, measured on the full (unsharded-side) buffer of the op:
the gathered result of an all-gather, the input of a reduce-scatter, the buffer of an all-reduce,
all-to-all or collective-permute. Combined ops (several tensors in one collective) count once with
the sum of their tensors. Asynchronous ops (`-start` / `-done`, as GPUs emit) count at the start.

`partitioned_collectives` reads the program as the SPMD partitioner leaves it instead, before the
backend's own passes: XLA:CPU (jax 0.10) widens the operands of bf16 matmuls to fp32 and moves that
convert in front of the all-gathers that feed them, so the optimized CPU program gathers and
reduces bf16 weights in fp32; the partitioned program shows the dtype the step asks for, which is
what a backend with bf16 matmuls (a GPU) moves. Its loops carry no trip-count annotation yet; a
scan's is read from its condition (`i < N`).
"""
import collections
import contextlib
import glob
import os
import re
import tempfile

import jax
from jax.experimental.compilation_cache import compilation_cache

from parallel.hlo_arrays import arrays

KINDS = ('all-gather', 'reduce-scatter', 'all-reduce', 'all-to-all', 'collective-permute')

_COMPUTATION = re.compile(r'^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$')
_INSTRUCTION = re.compile(r'=\s*(.+?)\s+(' + '|'.join(KINDS) + r')(-start)?\(')
_WHILE = re.compile(r'\swhile\(.*body=%?([\w.\-]+)')
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLED = re.compile(r'(?:calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)')
_BRANCHES = re.compile(r'branch_computations=\{([^}]*)\}')
_CONDITION = re.compile(r'condition=%?([\w.\-]+)')
_S32_CONSTANT = re.compile(r's32\[\] constant\((\d+)\)')


def _array_bytes(type_text: str) -> list[int]:
  return [size for size, _ in arrays(type_text)]


def _operands_and_results(type_text: str) -> tuple[list[int], list[int]]:
  """An async start's type is `((operands...), (results...))`, or `(operand, result, ...)`."""
  text = type_text.strip()
  if text.startswith('(('):
    depth, split = 0, None
    for i, ch in enumerate(text[1:], start=1):
      depth += ch == '('
      depth -= ch == ')'
      if depth == 0:
        split = i + 1
        break
    return _array_bytes(text[:split]), _array_bytes(text[split:])
  sizes = _array_bytes(text)
  return sizes[:1], sizes[1:2]


def _group_size(line: str, num_devices: int) -> int:
  """Devices in one replica group, from any of the HLO spellings of replica_groups."""
  named = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)
  if named:
    sizes = {k: int(v) for k, v in re.findall(r"'([^']+)'=(\d+)", named.group(1))}
    size = 1
    for axis, sub in re.findall(r"'([^']+)'(?::\(\d+\)(\d+))?", named.group(2)):
      size *= int(sub) if sub else sizes.get(axis, 1)
    return size
  iota = re.search(r'replica_groups=\[(\d+),(\d+)\]<=', line)
  if iota:
    return int(iota.group(2))
  explicit = re.search(r'replica_groups=\{\{([\d,]*)\}', line)
  if explicit:
    return len([d for d in explicit.group(1).split(',') if d])
  return num_devices   # replica_groups={} or absent: every device


def _op_bytes(kind: str, started: bool, type_text: str, line: str, num_devices: int) -> int:
  if started:
    operands, results = _operands_and_results(type_text)
    if kind == 'all-reduce':
      return sum(_array_bytes(type_text)) if not type_text.strip().startswith('((') else sum(results)
    return sum(operands) if kind == 'reduce-scatter' else sum(results)
  total = sum(_array_bytes(type_text))
  return total * _group_size(line, num_devices) if kind == 'reduce-scatter' else total


def _parse(hlo_text: str, num_devices: int):
  """computation name -> (its own collectives, [(called computation, times)]), and the entry."""
  computations, entry, current = {}, None, None
  constants: dict[str, list[int]] = collections.defaultdict(list)   # s32 scalars, per computation
  unannotated = []   # (calls list, index, condition): loops whose trip count is read afterwards
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line) if line[:1] not in ' \t' else None
    if header:
      current = header.group(1)
      computations[current] = ([], [])
      if line.startswith('ENTRY'):
        entry = current
      continue
    if current is None:
      continue
    own, calls = computations[current]
    constants[current].extend(int(n) for n in _S32_CONSTANT.findall(line))
    op = _INSTRUCTION.search(line)
    if op:
      type_text, kind, started = op.groups()
      own.append((kind, _op_bytes(kind, bool(started), type_text, line, num_devices)))
    loop = _WHILE.search(line)
    if loop:
      trips = _TRIP_COUNT.search(line)
      calls.append((loop.group(1), int(trips.group(1)) if trips else 1))
      condition = _CONDITION.search(line)
      if not trips and condition:
        unannotated.append((calls, len(calls) - 1, condition.group(1)))
    calls.extend((name, 1) for name in _CALLED.findall(line))
    for branches in _BRANCHES.findall(line):
      calls.extend((b.strip().lstrip('%'), 1) for b in branches.split(',') if b.strip())
  for calls, index, condition in unannotated:   # a scan's condition is `i < N`: one constant
    if len(constants[condition]) == 1:
      calls[index] = (calls[index][0], constants[condition][0])
  return computations, entry


def collective_stats(hlo_text: str, num_devices: int = 1) -> dict[str, dict[str, int]]:
  """{'all-gather': {'count': n, 'bytes': b}, ...} executed per step, for every kind in KINDS."""
  computations, entry = _parse(hlo_text, num_devices)
  memo: dict[str, collections.Counter] = {}

  def total(name: str, depth: int = 0) -> collections.Counter:
    if name in memo:
      return memo[name]
    counts = collections.Counter()
    if name in computations and depth < 64:
      own, calls = computations[name]
      for kind, size in own:
        counts[(kind, 'count')] += 1
        counts[(kind, 'bytes')] += size
      for child, times in calls:
        for key, value in total(child, depth + 1).items():
          counts[key] += times * value
    memo[name] = counts
    return counts

  counts = total(entry) if entry else collections.Counter()
  return {kind: {'count': counts[(kind, 'count')], 'bytes': counts[(kind, 'bytes')]}
          for kind in KINDS}


def partitioned_collectives(lowered, num_devices: int) -> dict[str, dict[str, int]]:
  """`collective_stats` of a lowered jit program as the SPMD partitioner emits it (see the module
  docstring)."""
  return collective_stats(partitioned_text(lowered), num_devices)


@contextlib.contextmanager
def persistent_cache_off():
  """JAX's persistent compilation cache off inside, as it was after (JAX decides once whether the
  cache is used; resetting it makes JAX decide again)."""
  enabled = jax.config.jax_enable_compilation_cache
  jax.config.update('jax_enable_compilation_cache', False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update('jax_enable_compilation_cache', enabled)
    compilation_cache.reset_cache()


def compile_with_dumps(lowered, compiler_options: dict):
  """`lowered.compile(compiler_options)` for the files XLA dumps while it compiles, with the
  persistent cache off: its key leaves the dump options out, so a program compiled before (or with
  other dumps) would be loaded from it and nothing dumped."""
  with persistent_cache_off():
    return lowered.compile(compiler_options=compiler_options)


def partitioned_text(lowered) -> str:
  """The HLO text of a lowered jit program as the SPMD partitioner leaves it. Compiles it once
  more, with XLA dumping the partitioner's output to a scratch folder."""
  with tempfile.TemporaryDirectory() as folder:
    compile_with_dumps(lowered, {'xla_dump_to': folder,
                                 'xla_dump_hlo_pass_re': 'spmd-partitioning'})
    dumps = sorted(glob.glob(os.path.join(folder, '*after_spmd-partitioning*.txt')))
    if not dumps:
      raise RuntimeError('XLA wrote no dump after spmd-partitioning; this XLA names its passes '
                         'differently')
    with open(dumps[-1]) as f:
      return f.read()
