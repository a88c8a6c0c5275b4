"""bench/profile.py on the tiny preset: the trace is read back into time per model part and kind,
and the real loop's data path is seen in its thread (JAX's trace format differs between versions:
this runs on each stack); the bytes each operation moves; bench/studies/pieces.py's table."""
import json
import os
import subprocess

from tests.helpers import python
from tests.test_docs import run_documented
from tests.test_run import ROOT


def test_the_profile_splits_the_step_and_sees_the_feed(tmp_path):
  """docs/speed.md's command, run once for the guide and this test, over two simulated devices
  (which must be set before the compilation cache asks how many there are)."""
  output = run_documented('docs/speed.md', 'python -m bench.profile --config=configs/default.py',
                          tmp_path, 'bench.profile:--out=profile.json',
                          'bench.profile:--config.host_devices=2')
  out = tmp_path / 'profile.json'
  profile = json.loads(out.read_text())
  assert profile['kinds_ms']['matmul'] > 0
  regions = {key.split('/')[0] for key, ms in profile['groups_ms'].items() if ms > 0}
  assert {'attention', 'mlp', 'norm', 'optimizer'} <= regions, regions
  assert 0 < profile['xla_busy_ms'] and 0 < profile['fraction_of_matmul_rate'] < 1
  assert profile['loop']['tokens_per_sec'] > 0 and profile['loop']['read_ms_per_step'] > 0
  assert 'slowest operations' in output
  others = profile['top_other_ops']
  assert others and all(r['kind'] != 'matmul' for r in others)
  assert any(r.get('bytes_per_sec', 0) > 0 and r['streaming_bytes_per_sec'] > 0 for r in others)


def test_an_operation_on_a_slice_of_a_stack_moves_only_the_slice():
  """The bytes the profile divides by an operation's time: a scan body's fusion reads one layer's
  slice of the stacked input, and its in-place update writes one slice, not the whole stack."""
  import jax
  import jax.numpy as jnp

  from bench.hlo_ops import describe_instructions

  def scanned(xs, c):
    return jax.lax.scan(lambda c, x: (c + jnp.tanh(x), c * 2), c, xs)

  layer = 1024 * 256 * 4
  hlo = jax.jit(scanned).lower(jnp.ones((8, 1024, 256)), jnp.ones((1024, 256))).compile().as_text()
  described = describe_instructions(hlo)
  in_loop = [d for d in described.values() if d['opcode'] in ('add', 'dynamic-update-slice')
             and d['shape'].startswith(('f32[1024,256]', 'f32[8,1024,256]'))]
  assert {d['opcode'] for d in in_loop} == {'add', 'dynamic-update-slice'}, described
  # No operation in the loop moves more than three layers' worth (two inputs and an output, or an
  # update read and written); the whole stack is eight.
  assert all(d['bytes'] <= 3 * layer + 64 for d in in_loop), in_loop


def test_the_pieces_are_timed_in_both_libraries(tmp_path):
  out, env = tmp_path / 'pieces.json', {**os.environ, 'JAX_PLATFORMS': 'cpu'}
  result = subprocess.run(
      [*python(env), '-m', 'bench.studies.pieces', '--shape=small', '--only=rmsnorm|adamw',
       '--repeats=1', f'--out={out}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600, env=env)
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  rows = {r['piece']: r for r in json.loads(out.read_text())['rows']}
  assert set(rows) == {'rmsnorm fwd+bwd', 'adamw + clipping, all weights'}
  try:
    import torch  # noqa: F401   a test-only requirement, absent from the other stacks' venvs
    both = True
  except ImportError:
    both = False
  for row in rows.values():
    assert row['xla_ms'] > 0 and row['bytes'] > 0 and row['stream_bytes_per_sec'] > 0
    assert ('torch_ms' in row) == both


# A trace of the 1b step (bf16_mixed, remat dots, 8 x 2048 tokens, 2 steps, command buffers on as a
# run has them) recorded by `python -m bench.profile --trace_dir=DIR` on one NVIDIA H200 with jax
# 0.11.2 (../shared/gpu-traces/h200-1b-bf16-dots, its README: 317.7 ms of kernels per step, summed
# by hand from the same file).
GPU_TRACE = os.path.join(ROOT, 'tests', 'data', 'h200-1b-bf16-dots.trace.json.gz')


def _gpu_kernels(tmp_path):
  import shutil

  from bench.gpu_kernels import device_events
  from bench.trace import read_trace
  shutil.copy(GPU_TRACE, tmp_path / 'vm.trace.json.gz')
  return device_events(read_trace(str(tmp_path)))


def test_a_gpu_trace_is_read_into_kernel_kinds(tmp_path):
  """Every kernel of the H200 trace is on the GPU's streams and has a kind; the sums are the ones
  counted by hand (a kernel's duration is in µs to the ns, so 0.05 ms per step is rounding)."""
  from bench.gpu_kernels import kernel_time, slowest_kernels
  kernels = _gpu_kernels(tmp_path)
  time = kernel_time(kernels, steps=2)
  assert time['kernels'] == 1852 and abs(time['busy'] - 317.4) < 0.05 and time['idle'] < 2
  kinds = time['kinds']
  for kind, ms in {'cuBLAS GEMM': 141.1, 'cuBLAS GEMM fp32': 60.6, 'cuDNN': 33.6,
                   'Triton GEMM': 27.8, 'reduction fusion': 15.0}.items():
    assert abs(kinds[kind] - ms) < 0.05, (kind, kinds)
  assert kinds.get('other', 0) < 0.05   # nothing left unnamed
  # The two fp32 GEMMs on TF32 (the 19 %): one launch per step each.
  fp32 = [r for r in slowest_kernels(kernels, 2, 10) if r['kind'] == 'cuBLAS GEMM fp32']
  assert len(fp32) == 2 and all(r['launches'] == 1 for r in fp32)
  # And as `python -m bench.gpu_kernels DIR --steps=2` prints it.
  import contextlib
  import io

  from bench import gpu_kernels
  printed = io.StringIO()
  with contextlib.redirect_stdout(printed):
    gpu_kernels.main([str(tmp_path), '--steps=2'])
  assert 'cuBLAS GEMM fp32 60.6' in printed.getvalue()
  assert '1,852 per step, busy 317.4 ms' in printed.getvalue()


def test_a_kernel_is_attributed_to_its_hlo_operation():
  """The trace's `hlo_op` where it is one of the program's; else the fusion its name was made
  from; a library kernel inside a command buffer belongs to none."""
  from bench.gpu_kernels import kernel_instruction
  described = {'loop_convert_fusion.12': {}, 'custom-call.5': {}, 'fusion': {}}
  in_buffer = {'hlo_op': 'command_buffer_73'}
  assert kernel_instruction({'name': 'loop_convert_fusion_12', 'args': in_buffer},
                            described) == 'loop_convert_fusion.12'
  assert kernel_instruction({'name': 'fusion', 'args': in_buffer}, described) == 'fusion'
  assert kernel_instruction({'name': 'nvjet_sm90_tst_128x160', 'args': in_buffer}, described) is None
  assert kernel_instruction({'name': 'nvjet_sm90_tst_128x160', 'args': {'hlo_op': 'custom-call.5'}},
                            described) == 'custom-call.5'


def test_the_gpu_profile_turns_command_buffers_off_only_on_a_gpu(monkeypatch):
  """On a CUDA GPU the profile asks XLA for no command buffers (a user's own setting kept); on any
  other backend XLA_FLAGS is left alone."""
  from bench import gpu_kernels
  from parallel import xla_flags
  environ = {'XLA_FLAGS': '--xla_dump_to=/tmp/x'}
  monkeypatch.setattr(xla_flags, 'cuda_expected', lambda platforms, environ: False)
  assert not gpu_kernels.without_command_buffers(environ) and environ['XLA_FLAGS'] == '--xla_dump_to=/tmp/x'
  monkeypatch.setattr(xla_flags, 'cuda_expected', lambda platforms, environ: True)
  assert gpu_kernels.without_command_buffers(environ)
  assert environ['XLA_FLAGS'] == '--xla_dump_to=/tmp/x --xla_gpu_enable_command_buffer='
  mine = {'XLA_FLAGS': '--xla_gpu_enable_command_buffer=FUSION'}
  assert not gpu_kernels.without_command_buffers(mine)
  assert mine['XLA_FLAGS'] == '--xla_gpu_enable_command_buffer=FUSION'
