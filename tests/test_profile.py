"""bench/profile.py on the tiny preset: the trace is read back into time per model part and kind,
and the real loop's data path is seen in its thread (JAX's trace format differs between versions:
this runs on each stack); the bytes each operation moves; bench/studies/pieces.py's table."""
import json
import os
import subprocess
import sys

from tests.test_run import ROOT


def test_the_profile_splits_the_step_and_sees_the_feed(tmp_path):
  out = tmp_path / 'profile.json'
  result = subprocess.run(
      [sys.executable, '-m', 'bench.profile', '--config=configs/default.py:tiny', '--steps=2',
       '--warmup=1', '--config.compile_cache=', f'--out={out}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
  profile = json.loads(out.read_text())
  assert profile['kinds_ms']['matmul'] > 0
  regions = {key.split('/')[0] for key, ms in profile['groups_ms'].items() if ms > 0}
  assert {'attention', 'mlp', 'norm', 'optimizer'} <= regions, regions
  assert 0 < profile['xla_busy_ms'] and 0 < profile['fraction_of_matmul_rate'] < 1
  assert profile['loop']['tokens_per_sec'] > 0 and profile['loop']['read_ms_per_step'] > 0
  assert 'slowest operations' in result.stdout
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
  out = tmp_path / 'pieces.json'
  result = subprocess.run(
      [sys.executable, '-m', 'bench.studies.pieces', '--shape=small', '--only=rmsnorm|adamw',
       '--repeats=1', f'--out={out}'],
      cwd=ROOT, capture_output=True, text=True, timeout=600,
      env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
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
