"""bench/profile.py on the tiny preset: the trace is read back into time per model part and kind,
and the real loop's data path is seen in its thread (JAX's trace format differs between versions:
this runs on each stack)."""
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
