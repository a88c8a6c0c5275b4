"""What each instruction of a compiled XLA program is, read from its HLO text: its opcode, the part
of the model that made it (the name scopes `embed`, `norm`, `attention`, `mlp`, `loss`,
`optimizer`; forward or backward), its kind (matmul, elementwise, copy/transpose, data movement,
collective) and the bytes it reads and writes (a layer's slice of a stacked operand counted as the
slice). bench/profile.py joins it with the profiler's trace; it defines no flags, so anything may
import it.
"""
import re

from parallel.hlo_arrays import type_bytes

REGIONS = ('embed', 'norm', 'attention', 'mlp', 'loss', 'optimizer')
KINDS = ('matmul', 'elementwise', 'copy/transpose', 'data movement', 'collective', 'other')
_COLLECTIVES = ('all-reduce', 'all-gather', 'reduce-scatter', 'all-to-all', 'collective-permute')
_MOVEMENT = ('dynamic-slice', 'dynamic-update-slice', 'gather', 'scatter', 'concatenate', 'pad',
             'slice', 'broadcast', 'iota')
_CONTAINERS = ('while', 'conditional', 'call', 'async-start', 'async-done')
_MATMUL_CALLS = ('gemm', 'cublas', 'matmul', 'onednn', 'fmha', 'cudnn', 'triton')


# ---- the compiled program: what each instruction is ---------------------------------------------
def _computations(hlo: str) -> dict[str, list[str]]:
  """Computation name -> its instruction lines."""
  bodies, name = {}, None
  for line in hlo.splitlines():
    header = re.match(r'^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$', line)
    if header and not line.startswith(' '):
      name = header.group(1)
      bodies[name] = []
    elif name is not None and line.startswith('  '):
      bodies[name].append(line)
  return bodies


_INSTRUCTION = re.compile(r'^\s*(?:ROOT )?%?([\w.\-]+) = (\S+(?: \S+)*?) ([\w\-]+)\((.*)$')


def _opcode(line: str) -> str | None:
  match = _INSTRUCTION.match(line)
  return match.group(3) if match else None


def _region(op_name: str) -> str:
  """The model part an instruction belongs to, from the name scopes in its op_name."""
  for part in op_name.split('/'):
    bare = re.sub(r'^(?:\w+\()+|\)+$', '', part)   # jvp(loss), transpose(jvp(mlp)) -> loss, mlp
    if bare in REGIONS:
      return bare
  return 'other'


def _operands(rest: str) -> list[str]:
  """The operand names of an instruction, from the text after its opcode's '('."""
  depth, end = 1, 0
  for end, char in enumerate(rest):
    depth += {'(': 1, ')': -1}.get(char, 0)
    if depth == 0:
      break
  return re.findall(r'%([\w.\-]+)', rest[:end])


def _moved_bytes(opcode: str, shape: str, operands: list[str], shapes: dict, body: list[str]) -> float:
  """Bytes an instruction reads and writes once: its operands and its output, except that a slice
  of a larger operand (a layer's slice of a scanned stack) reads only the slice, and an in-place
  update of one writes only the update."""
  sizes = [type_bytes(shapes.get(o, '')) for o in operands]
  written = type_bytes(shape)
  if opcode == 'dynamic-slice':
    return 2 * written
  if opcode == 'dynamic-update-slice':
    return 2 * (sizes[1] if len(sizes) > 1 else 0)
  if not body:
    return written + sum(sizes)
  # A fusion: which of its parameters are only sliced, and is its root an in-place update?
  parameters, sliced, inner_shapes, root_update = {}, {}, {}, None
  for line in body:
    match = _INSTRUCTION.match(line)
    if not match:
      continue
    name, inner_shape, inner_op, inner_rest = match.groups()
    inner_shapes[name] = inner_shape
    if inner_op == 'parameter':
      parameters[name] = int(re.match(r'(\d+)', inner_rest).group(1))
    args = _operands(inner_rest)
    if inner_op == 'dynamic-slice' and args and args[0] in parameters:
      sliced[parameters[args[0]]] = sliced.get(parameters[args[0]], 0) + type_bytes(inner_shape)
    if inner_op == 'dynamic-update-slice' and 'ROOT' in line and args and args[0] in parameters:
      root_update = (parameters[args[0]], type_bytes(inner_shapes.get(args[1], '')))
  total = 0.0
  for i, size in enumerate(sizes):
    if root_update and i == root_update[0]:
      continue   # updated in place: the buffer is neither read nor written whole
    total += min(size, sliced[i]) if i in sliced else size
  return total + (root_update[1] if root_update else written)


def describe_instructions(hlo: str) -> dict[str, dict]:
  """Instruction name -> {'kind', 'region', 'opcode', 'backward', 'shape', 'bytes'} for every
  instruction of the compiled module (the names its trace events carry); `opcode` is a fusion's
  root's; `bytes` is what one execution reads and writes (`_moved_bytes`)."""
  bodies = _computations(hlo)
  shapes = {}
  for body in bodies.values():
    for line in body:
      match = _INSTRUCTION.match(line)
      if match:
        shapes[match.group(1)] = match.group(2)
  described = {}
  for body in bodies.values():
    for line in body:
      match = _INSTRUCTION.match(line)
      if not match:
        continue
      name, shape, opcode, rest = match.groups()
      if opcode in _CONTAINERS:   # their events span the operations inside, counted themselves
        continue
      op_name = re.search(r'op_name="([^"]*)"', rest)
      op_name = op_name.group(1) if op_name else ''
      called = re.search(r'calls=%?([\w.\-]+)', rest)
      called_body = bodies.get(called.group(1), []) if called else []
      inner = [_opcode(l) for l in called_body]
      root = next((_opcode(l) for l in called_body if 'ROOT' in l), None)
      target = re.search(r'custom_call_target="([^"]*)"', rest)
      target = target.group(1).lower() if target else ''
      ops = {opcode, *inner}
      if ops & {'dot', 'convolution'} or (opcode == 'custom-call' and
                                          any(t in target for t in _MATMUL_CALLS)):
        kind = 'matmul'
      elif any(opcode.startswith(c) for c in _COLLECTIVES):
        kind = 'collective'
      elif (root or opcode) in ('copy', 'transpose') or opcode in ('copy', 'transpose'):
        kind = 'copy/transpose'
      elif (root or opcode) in _MOVEMENT:
        kind = 'data movement'
      elif opcode in ('fusion', 'add', 'multiply', 'subtract', 'divide', 'exponential', 'reduce',
                      'select', 'compare', 'convert', 'maximum', 'negate', 'rsqrt', 'log', 'tanh'):
        kind = 'elementwise'
      else:
        kind = 'other'
      described[name] = {'kind': kind, 'region': _region(op_name), 'opcode': root or opcode,
                         'backward': 'transpose(' in op_name, 'shape': shape,
                         'bytes': _moved_bytes(opcode, shape, _operands(rest), shapes, called_body)}
  return described
