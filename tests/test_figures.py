"""The dry run's figures stay where they were recorded (bench/results/figures.json): compiled
per-device memory, the analytic estimate and the collectives per step of a few experiment configs,
byte for byte. `python -m bench.figures --against=...` checks every config; this keeps two in the
suite so a change that moves them fails here. Compiled figures belong to one compiler: under
another jax version than the recording's the test is skipped (record anew with --out)."""
import json
import os

import jax
import pytest

from bench.figures import ROOT, differences, dry_run_figures

RECORDED = os.path.join(ROOT, 'bench', 'results', 'figures.json')


@pytest.mark.parametrize('name', ['fsdp', 'qlora'])
def test_dry_run_figures_are_those_recorded(name):
  with open(RECORDED) as f:
    recorded = json.load(f)
  if recorded['jax'] != jax.__version__:
    pytest.skip(f'figures recorded with jax {recorded["jax"]}, this is jax {jax.__version__}')
  assert differences(recorded['configs'][name], dry_run_figures(name)) == []
