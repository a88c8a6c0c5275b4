"""The dry run's figures stay where they were recorded (bench/results/figures.json): compiled
per-device memory, the analytic estimate and the collectives per step, byte for byte.
`python -m bench.figures --against=...` checks every config; this keeps the default layout's in
the suite so a change that moves them fails here. Compiled figures belong to one compiler: under
another jax version than the recording's the test is skipped (record anew with --out)."""
import json
import os
import subprocess
import sys

import jax
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORDED = os.path.join(ROOT, 'bench', 'results', 'figures.json')


def test_the_fsdp_dry_run_figures_are_those_recorded():
  with open(RECORDED) as f:
    recorded = json.load(f)
  if recorded['jax'] != jax.__version__:
    pytest.skip(f'figures recorded with jax {recorded["jax"]}, this is jax {jax.__version__}')
  # A process of its own: bench.figures defines absl flags, as the run does.
  result = subprocess.run([sys.executable, '-m', 'bench.figures', '--only=fsdp',
                           f'--against={RECORDED}'], cwd=ROOT, capture_output=True, text=True,
                          timeout=900)
  assert result.returncode == 0 and 'fsdp       ok, unchanged' in result.stdout, (
      result.stdout + result.stderr[-2000:])
