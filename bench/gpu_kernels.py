"""What the kernels of a GPU trace are. A `jax.profiler` trace of a GPU step holds one event per
kernel on the device's streams (CUPTI's, in the process `/device:GPU:<n>`): the kernel's name, its
time, and in `args` the HLO operation that launched it (`hlo_op`). Inside a command buffer (a CUDA
graph, XLA's default for fusions and cuBLAS/cuDNN calls) that operation is the command buffer
itself; a fusion's kernel still carries its instruction's name (`loop_convert_fusion_12` for
`loop_convert_fusion.12`), a library's kernel carries only the library's name (`nvjet_sm90_*` for
cuBLAS, `cudnn_*` for cuDNN). So every kernel gets its kind from its name, and the instruction it
belongs to where the trace or its name says (bench/profile.py turns command buffers off on a GPU so
that all of them do).

Defines no flags: tests and other benchmarks import it. `without_command_buffers` turns XLA's
command buffers off before a backend starts, for a profile whose every kernel names its operation.
Run, it reads a trace already recorded (`bench.profile --trace_dir=DIR` on a GPU, or any
`jax.profiler` trace of one):

  python -m bench.gpu_kernels DIR --steps=2      # the steps the trace holds
"""
import argparse
import os
import re

import jax

from bench.trace import read_trace, union_us
from parallel import xla_flags

# What a kernel is, read from its name; in the order the profile prints them.
GPU_KINDS = ('cuBLAS GEMM', 'cuBLAS GEMM fp32', 'Triton GEMM', 'cuDNN', 'loop fusion',
             'reduction fusion', 'copy/transpose', 'memset', 'collective', 'host transfer', 'other')
MATMUL_KINDS = ('cuBLAS GEMM', 'cuBLAS GEMM fp32', 'Triton GEMM', 'cuDNN')

# (kind, pattern on the lower-cased kernel name), the first that matches; the order matters
# (`gemm_fusion_*` is XLA's Triton GEMM, not cuBLAS; `input_transpose_fusion` is a transpose).
_KIND_PATTERNS = (
    ('collective', r'nccl'),
    ('host transfer', r'memcpy.*(htod|dtoh|h2d|d2h)|(htod|dtoh)'),
    ('memset', r'^memset'),
    ('cuDNN', r'cudnn|fmha|sdpa'),
    ('Triton GEMM', r'^(gemm_fusion|triton)'),
    # cuBLAS on fp32 operands (TF32 tensor cores at best): `*_f32f32_tf32f32_*`, `sgemm`.
    ('cuBLAS GEMM fp32', r'(gemm|xmma).*(f32f32|tf32)|sgemm'),
    ('cuBLAS GEMM', r'^nvjet|gemm|xmma|cutlass|cublas'),
    ('copy/transpose', r'transpose|copy|^memcpy'),
    ('reduction fusion', r'^input_|reduce'),
    ('loop fusion', r'^(loop_|wrapped_|fusion)'),
)


# XLA's flag that lists what command buffers capture: empty, nothing is captured.
NO_COMMAND_BUFFERS = (('xla_gpu_enable_command_buffer', ''),)


def without_command_buffers(environ=os.environ) -> bool:
  """Before JAX starts a backend: command buffers off where JAX will run on a CUDA GPU (a flag the
  user's XLA_FLAGS already sets is kept). Whether they were turned off."""
  if not xla_flags.cuda_expected(jax.config.jax_platforms, environ):
    return False
  environ['XLA_FLAGS'], added = xla_flags.merged(environ.get('XLA_FLAGS', ''), NO_COMMAND_BUFFERS)
  return bool(added)


def kernel_kind(name: str) -> str:
  """The kind of a GPU kernel (one of GPU_KINDS), from its name."""
  lowered = name.lower()
  return next((kind for kind, pattern in _KIND_PATTERNS if re.search(pattern, lowered)), 'other')


def device_events(events: list[dict]) -> list[dict]:
  """The kernel and memory events of the GPU devices' streams (bench/profile.py:read_trace's
  events, which carry their process's name)."""
  return [e for e in events if e.get('process', '').startswith('/device:GPU')]


def kernel_instruction(event: dict, described: dict) -> str | None:
  """The HLO instruction a kernel belongs to: the trace's `hlo_op` where it is one of the
  program's (`described`), else the instruction its name was made from; None for a library kernel
  inside a command buffer."""
  op = event.get('args', {}).get('hlo_op')
  if op in described:
    return op
  for name in (event['name'], re.sub(r'_(\d+)$', r'.\1', event['name'])):
    if name in described:
      return name
  return None


def kernel_time(kernels: list[dict], steps: int) -> dict:
  """ms per step: busy (some kernel running), idle (the gaps between the first kernel and the
  last), by kind; and kernels per step."""
  intervals = [(e['ts'], e['ts'] + e['dur']) for e in kernels]
  if not intervals:
    return {'busy': 0.0, 'idle': 0.0, 'kinds': {}, 'kernels': 0.0}
  busy = union_us(intervals)
  span = max(end for _, end in intervals) - min(start for start, _ in intervals)
  by_kind = {}
  for e in kernels:
    by_kind.setdefault(kernel_kind(e['name']), []).append((e['ts'], e['ts'] + e['dur']))
  per_step = lambda us: us / 1e3 / steps
  return {'busy': per_step(busy), 'idle': per_step(span - busy),
          'kinds': {k: per_step(union_us(v)) for k, v in by_kind.items()},
          'kernels': len(kernels) / steps}


def slowest_kernels(kernels: list[dict], steps: int, top: int) -> list[dict]:
  """The kernels that take longest per step, summed by name: ms per step, launches per step, and
  the kind."""
  by_name = {}
  for e in kernels:
    total, count = by_name.get(e['name'], (0.0, 0))
    by_name[e['name']] = (total + e['dur'], count + 1)
  rows = [{'kernel': name, 'ms': us / 1e3 / steps, 'launches': count / steps,
           'kind': kernel_kind(name)} for name, (us, count) in by_name.items()]
  return sorted(rows, key=lambda r: -r['ms'])[:top]


def print_gpu_kernels(gpu: dict) -> None:
  """The GPU's kernels, as bench/gpu_kernels.py reads them: busy and idle time, by kind, and the
  slowest kernels by name."""
  if gpu['command_buffers'] is None:   # a trace read without its program (bench.gpu_kernels)
    attributed = 'read without the program: kinds from the kernels\' names'
  elif not gpu['command_buffers']:
    attributed = ('every kernel named its HLO operation (command buffers off: '
                  '--gpu_command_buffers keeps them, as a run has them)')
  else:
    attributed = (f'{gpu["attributed_ms"]:.1f} ms of it attributed to an HLO operation above '
                  f'(inside a command buffer a cuBLAS or cuDNN kernel names only the buffer)')
  print(f'  GPU kernels        {gpu["kernels"]:,.0f} per step, busy {gpu["busy"]:.1f} ms, idle '
        f'between kernels {gpu["idle"]:.1f} ms; {attributed}')
  print('  by kernel kind (ms per step): ' + ', '.join(
      f'{k} {gpu["kinds"][k]:.1f}' for k in GPU_KINDS if gpu['kinds'].get(k, 0) >= 0.05))
  matmul = sum(gpu['kinds'].get(k, 0.0) for k in MATMUL_KINDS)
  print(f'  matmuls and attention (cuBLAS, Triton GEMM, cuDNN) {matmul:.1f} ms, '
        f'{100 * matmul / gpu["busy"] if gpu["busy"] else 0:.0f} % of the busy time')
  print('  slowest kernels (ms per step, launches per step):')
  for r in gpu['slowest_kernels']:
    print(f'    {r["ms"]:7.2f}  {r["launches"]:5.0f}  {r["kind"]:16s} {r["kernel"][:72]}')


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(prog='python -m bench.gpu_kernels',
                                   description='The kernels of a recorded GPU trace, by kind.')
  parser.add_argument('trace_dir', help='a directory holding a *.trace.json.gz (the newest is read)')
  parser.add_argument('--steps', type=int, default=1, help='steps the trace holds (per-step figures)')
  parser.add_argument('--top', type=int, default=12, help='the slowest kernels listed')
  args = parser.parse_args(argv)
  if args.steps < 1:
    parser.error(f'--steps={args.steps}: at least 1')
  try:
    kernels = device_events(read_trace(args.trace_dir))
  except RuntimeError as e:
    parser.error(str(e))
  if not kernels:
    parser.error(f'{args.trace_dir}: the trace holds no GPU kernels (no /device:GPU process)')
  print(f'{args.trace_dir}: {args.steps} step(s)')
  print_gpu_kernels({**kernel_time(kernels, args.steps), 'command_buffers': None,
                     'slowest_kernels': slowest_kernels(kernels, args.steps, args.top)})


if __name__ == '__main__':
  main()
