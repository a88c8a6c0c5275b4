"""The dry run's figures stay where they were recorded: compiled per-device memory, the analytic
estimate and the collectives per step, byte for byte. Compiled figures belong to one compiler, so
they are recorded per jax version (`bench/results/figures*.json`, each naming its jax), and checked
under every version that has a record: jax 0.10.2 (the pins, every config), 0.11.2 and 0.12.0.1.
`python -m bench.figures --against=...` checks every config; this keeps the default layout's in
the suite so a change that moves them fails here."""
import glob
import json
import os
import subprocess

import jax
import pytest

from tests.helpers import python

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def recorded_for(version: str) -> str | None:
  """The figures file recorded under jax `version`, or None."""
  for path in sorted(glob.glob(os.path.join(ROOT, 'bench', 'results', 'figures*.json'))):
    with open(path) as f:
      if json.load(f)['jax'] == version:
        return path
  return None


def test_every_stack_the_project_runs_on_has_its_figures_recorded():
  for version in ('0.10.2', '0.11.2', '0.12.0.1'):
    path = recorded_for(version)
    assert path is not None, f'no bench/results/figures*.json recorded under jax {version}'
    with open(path) as f:
      assert 'fsdp' in json.load(f)['configs']


def test_the_fsdp_dry_run_figures_are_those_recorded():
  recorded = recorded_for(jax.__version__)
  if recorded is None:   # a stack the project does not name: nothing recorded to compare with
    pytest.skip(f'no figures recorded under jax {jax.__version__} (record with bench.figures --out)')
  # A process of its own: bench.figures defines absl flags, as the run does. Compiled as a user
  # compiles, without the suite's quicker compile (tests/helpers.py:QUICK_COMPILE).
  result = subprocess.run([*python(os.environ), '-m', 'bench.figures', '--only=fsdp',
                           f'--against={recorded}'], cwd=ROOT, capture_output=True, text=True,
                          timeout=900, env={**os.environ, 'XLA_FLAGS': ''})
  assert result.returncode == 0 and 'fsdp       ok, unchanged' in result.stdout, (
      result.stdout + result.stderr[-2000:])
