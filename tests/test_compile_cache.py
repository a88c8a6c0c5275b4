"""JAX's persistent compilation cache (train/compile_cache.py): on by default in a per-user
directory, another with `compile_cache`, off with `compile_cache=''`; a rerun loads the train step
instead of compiling it; memory.json and the log report the compile's seconds. Real `main.py`
processes, each with its cache in a temporary directory (the suite's own cache, tests/conftest.py,
is left out of their environment)."""
import json
import os
import subprocess
import sys

import jax
import pytest

from tests.helpers import child_environ
from tests.test_run import ROOT, small_corpus
from train import compile_cache


def main_py(*args, **env):
  """main.py without the suite's cache settings, and with `env` added."""
  environ = {k: v for k, v in child_environ().items()
             if k not in ('JAX_ENABLE_COMPILATION_CACHE', 'JAX_COMPILATION_CACHE_DIR')}
  return subprocess.run([sys.executable, os.path.join(ROOT, 'main.py'),
                         '--config=configs/default.py:tiny', *args],
                        cwd=ROOT, env={**environ, **env},
                        capture_output=True, text=True, timeout=600)


def train_step_entries(cache) -> set[str]:
  return {p.name for p in cache.iterdir() if p.name.startswith('jit_train_step-')}


def test_a_rerun_loads_the_train_step_from_the_users_cache(tmp_path):
  # First a dry run with the default location ($XDG_CACHE_HOME/less-memory-lm/jax): it compiles
  # the step and keeps it.
  cache = tmp_path / 'xdg' / 'less-memory-lm' / 'jax'
  same = ('--config.train.steps=2', f'--config.data.path={small_corpus(tmp_path)}')
  first = main_py('--dry_run', f'--workdir={tmp_path / "dry"}', *same,
                  XDG_CACHE_HOME=str(tmp_path / 'xdg'))
  assert first.returncode == 0, first.stderr[-3000:]
  written = train_step_entries(cache)
  assert len(written) == 1
  dry = json.loads((tmp_path / 'dry' / 'memory.json').read_text())
  assert dry['compile_seconds'] > 0 and dry['compile_cache_hit'] is False
  assert f'persistent compilation cache: {cache}' in first.stdout

  # Then a training run of the same config (the step holds the learning-rate schedule, so the
  # same steps), the directory named by the key: its train step is the dry run's program, loaded
  # (same memory and collectives), not compiled again.
  second = main_py(f'--workdir={tmp_path / "run"}', f'--config.compile_cache={cache}', *same,
                   XDG_CACHE_HOME=str(tmp_path / 'elsewhere'))
  assert second.returncode == 0, second.stderr[-3000:]
  run = json.loads((tmp_path / 'run' / 'memory.json').read_text())
  assert run['compile_cache_hit'] is True and run['compile_seconds'] > 0
  assert train_step_entries(cache) == written
  for key in ('per_device_bytes', 'estimate_bytes', 'collectives_per_step'):
    assert run[key] == dry[key], key
  compiled_line = next(line for line in second.stdout.splitlines() if line.startswith('compiled'))
  assert compiled_line == (f'compiled    train step in {run["compile_seconds"]:.1f} s (loaded from '
                           f'the persistent compilation cache {cache})')
  assert not (tmp_path / 'elsewhere').exists()


def test_an_empty_compile_cache_turns_it_off(tmp_path):
  # Off even where JAX's own variable names a directory.
  result = main_py('--dry_run', f'--workdir={tmp_path / "w"}', '--config.compile_cache=',
                   XDG_CACHE_HOME=str(tmp_path / 'xdg'), JAX_COMPILATION_CACHE_DIR=str(tmp_path / 'jax'))
  assert result.returncode == 0, result.stderr[-3000:]
  memory = json.loads((tmp_path / 'w' / 'memory.json').read_text())
  assert memory['compile_seconds'] > 0 and memory['compile_cache_hit'] is None
  assert '(persistent compilation cache off)' in result.stdout
  assert not (tmp_path / 'xdg').exists() and not (tmp_path / 'jax').exists()


def test_a_compile_cache_that_is_a_file_is_refused_in_one_line(tmp_path):
  (tmp_path / 'taken').write_text('not a directory')
  result = main_py('--dry_run', f'--workdir={tmp_path / "w"}',
                   f'--config.compile_cache={tmp_path / "taken"}')
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr
  assert result.stderr.strip().splitlines()[-1] == (
      f"error: compile_cache='{tmp_path / 'taken'}' is a file, not a directory; give a directory, "
      f"or --config.compile_cache='' to turn the persistent compilation cache off")
  assert not (tmp_path / 'w').exists()


def test_what_is_not_a_path_is_refused():
  for value in (None, 3):
    with pytest.raises(compile_cache.CacheDirError, match='it must be a directory path'):
      compile_cache.enable(value)


def test_a_run_over_several_cpu_devices_compiles_and_keeps_nothing(tmp_path):
  # Loaded from the cache, an XLA:CPU program over several devices can run its collectives in
  # another order on each device and hang (train/compile_cache.py:unserved): compiled, every time.
  cache = tmp_path / 'cache'
  result = main_py('--dry_run', '--host_devices=2', f'--workdir={tmp_path / "w"}',
                   f'--config.compile_cache={cache}')
  assert result.returncode == 0, result.stderr[-3000:]
  memory = json.loads((tmp_path / 'w' / 'memory.json').read_text())
  assert memory['compile_cache_hit'] is None
  assert '(persistent compilation cache off for XLA:CPU over 2 devices)' in result.stdout
  assert not cache.exists()   # nothing kept, so nothing a rerun could load


def test_in_process_programs_over_the_suites_eight_cpu_devices_are_not_served_either():
  assert compile_cache.unserved() == f'XLA:CPU over {len(jax.devices())} devices'
  assert compile_cache.cache_dir() is None
  assert compile_cache.unserved(gpu_target=True) == 'a GPU target compiled on the CPU'
