"""The dry run's figures of every experiment config, recorded, and compared byte for byte.

A change that should not change behaviour (a restructuring) must leave every config's compiled
memory, estimate and collective traffic exactly as they were. This runs `python main.py
--config=configs/<name>.py --dry_run` for every config file (each in its own process, with its own
simulated devices, as a user would) and keeps the figures of each `memory.json`:

  python -m bench.figures --out=bench/results/figures.json        # record
  python -m bench.figures --against=bench/results/figures.json    # compare; exit 1 if any moved

Compiled figures belong to one compiler: a file recorded under another jax version is refused
rather than compared. Each stack the project runs on has its own record: figures.json (jax
0.10.2, the pins), figures-jax0.11.2.json and figures-jax0.12.0.1.json (record one with that
stack's python and `--out`); tests/test_figures.py checks the one of the running jax.
"""
import glob
import json
import os
import subprocess
import sys
import tempfile

import jax
from absl import app, flags

_OUT = flags.DEFINE_string('out', None, 'Write the figures to this JSON file.')
_AGAINST = flags.DEFINE_string('against', None, 'Compare the figures with this JSON file.')
_ONLY = flags.DEFINE_list('only', None, 'Config names to run (default: every config file).')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What a dry run's memory.json says that must not move: the compiled per-device bytes, the
# analytic estimate (CPU and GPU) and the collectives per step.
KEPT = ('num_params', 'trainable_params', 'frozen_bytes', 'mesh', 'per_device_bytes',
        'estimate_bytes', 'estimate_gpu_bytes', 'collectives_per_step')


def config_names() -> list[str]:
  """Every config file that defines get_config (the shared helpers, e.g. presets.py, do not)."""
  names = []
  for path in sorted(glob.glob(os.path.join(ROOT, 'configs', '*.py'))):
    with open(path) as f:
      if 'def get_config' in f.read():
        names.append(os.path.splitext(os.path.basename(path))[0])
  return names


def dry_run_figures(name: str) -> dict:
  """The kept part of `memory.json` from a dry run of configs/<name>.py, or the error it printed."""
  with tempfile.TemporaryDirectory() as workdir:
    result = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'main.py'), f'--config=configs/{name}.py', '--dry_run',
         f'--workdir={workdir}'], cwd=ROOT, capture_output=True, text=True, timeout=900)
    memory_file = os.path.join(workdir, 'memory.json')
    if result.returncode != 0 or not os.path.exists(memory_file):
      lines = (result.stderr or result.stdout).strip().splitlines()
      return {'error': lines[-1] if lines else f'exit {result.returncode}'}
    with open(memory_file) as f:
      memory = json.load(f)
  return {key: memory[key] for key in KEPT if key in memory}


def differences(recorded: dict, now: dict, path: str = '') -> list[str]:
  """Every leaf that differs, as 'path: recorded -> now'."""
  if isinstance(recorded, dict) and isinstance(now, dict):
    out = []
    for key in sorted(set(recorded) | set(now)):
      out += differences(recorded.get(key), now.get(key), f'{path}.{key}' if path else key)
    return out
  return [] if recorded == now else [f'{path}: {recorded!r} -> {now!r}']


def main(argv):
  del argv
  names = _ONLY.value or config_names()
  recorded = None
  if _AGAINST.value:
    with open(_AGAINST.value) as f:
      recorded = json.load(f)
    if recorded['jax'] != jax.__version__:
      sys.exit(f'error: {_AGAINST.value} was recorded with jax {recorded["jax"]}, this is jax '
               f'{jax.__version__}; compiled figures of two compilers are not comparable '
               f'(record anew with --out)')
  figures = {'jax': jax.__version__, 'configs': {}}
  moved = []
  for name in names:
    figures['configs'][name] = dry_run_figures(name)
    got = figures['configs'][name]
    status = f'error: {got["error"]}' if 'error' in got else 'ok'
    if recorded is not None:
      found = differences(recorded['configs'].get(name, {}), figures['configs'][name])
      moved += [f'{name}.{line}' for line in found]
      status += f', {len(found)} figure(s) moved' if found else ', unchanged'
    print(f'{name:10s} {status}', flush=True)
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(figures, f, indent=1, sort_keys=True)
  if moved:
    print('\n'.join(moved))
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
