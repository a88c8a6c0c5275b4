"""The GPU's default XLA flags (parallel/xla_flags.py): added to XLA_FLAGS only when JAX will run on
a CUDA GPU, never over a flag the user set, idempotent; and every one of them known to the installed
XLA (an unknown flag aborts the process). No GPU needed: the detection is steered by its inputs."""
import os
import subprocess
import sys

import pytest

from parallel import xla_flags

USER = '--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false'


def test_the_users_value_wins_and_the_rest_is_appended():
  value, added = xla_flags.merged(USER)
  names = [name for name, _ in xla_flags.GPU_TRAINING_FLAGS]
  assert value.startswith(USER + ' ')
  assert '--xla_gpu_enable_latency_hiding_scheduler=true' not in value
  assert added == [f'--{n}={v}' for n, v in xla_flags.GPU_TRAINING_FLAGS
                   if n != 'xla_gpu_enable_latency_hiding_scheduler']
  assert xla_flags.flag_names(value) == {'xla_force_host_platform_device_count', *names}


def test_merging_twice_changes_nothing_more():
  once, _ = xla_flags.merged('')
  twice, added = xla_flags.merged(once)
  assert twice == once and added == []


def test_flag_names_reads_bare_and_quoted_flags():
  assert xla_flags.flag_names("--xla_gpu_enable_command_buffer='' --xla_dump_hlo_as_text "
                              '--xla_dump_to="/tmp/a b"') == {
      'xla_gpu_enable_command_buffer', 'xla_dump_hlo_as_text', 'xla_dump_to'}


@pytest.fixture
def cuda_machine(monkeypatch):
  """A machine with a CUDA plugin installed and a device the driver shows."""
  monkeypatch.setattr(xla_flags, '_installed', lambda module: module == 'jax_plugins.xla_cuda12')
  monkeypatch.setattr(xla_flags.glob, 'glob', lambda pattern: ['/dev/nvidia0'])


@pytest.mark.parametrize('platforms', [None, '', 'cuda', 'cuda,cpu', 'gpu'])
def test_a_cuda_gpu_gets_the_defaults_once(cuda_machine, platforms):
  environ = {'XLA_FLAGS': USER}
  added = xla_flags.apply(platforms, environ)
  assert len(added) == len(xla_flags.GPU_TRAINING_FLAGS) - 1
  assert environ['XLA_FLAGS'] == xla_flags.merged(USER)[0]
  assert xla_flags.apply(platforms, environ) == []
  assert environ['XLA_FLAGS'] == xla_flags.merged(USER)[0]


@pytest.mark.parametrize('platforms, environ', [
    ('cpu', {}),                                 # JAX_PLATFORMS=cpu (the suite, a plan)
    ('tpu', {}),
    (None, {'CUDA_VISIBLE_DEVICES': ''}),        # every device hidden
    (None, {'CUDA_VISIBLE_DEVICES': '-1'}),
])
def test_nothing_is_added_where_jax_will_not_run_on_a_cuda_gpu(cuda_machine, platforms, environ):
  environ = {**environ, 'XLA_FLAGS': USER}
  assert xla_flags.apply(platforms, environ) == [] and environ['XLA_FLAGS'] == USER


def test_nothing_is_added_without_a_cuda_plugin_or_a_device(monkeypatch):
  environ = {}
  monkeypatch.setattr(xla_flags, '_installed', lambda module: False)
  monkeypatch.setattr(xla_flags.glob, 'glob', lambda pattern: ['/dev/nvidia0'])
  assert xla_flags.apply(None, environ) == [] and environ == {}
  monkeypatch.setattr(xla_flags, '_installed', lambda module: True)
  monkeypatch.setattr(xla_flags.glob, 'glob', lambda pattern: [])
  monkeypatch.setattr(xla_flags.os.path, 'exists', lambda path: False)
  assert xla_flags.apply(None, environ) == [] and environ == {}


def test_the_installed_xla_knows_every_default_flag():
  """XLA parses every flag on any backend and aborts on one it does not know: a jaxlib that drops
  one of these fails here, on the CPU, before any GPU run does."""
  flags, _ = xla_flags.merged('')
  program = 'import jax; jax.numpy.zeros(3).block_until_ready()'
  done = subprocess.run([sys.executable, '-c', program],
                        env={**os.environ, 'XLA_FLAGS': flags, 'JAX_PLATFORMS': 'cpu'},
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]


COMBINE = 'xla_gpu_all_gather_combine_threshold_bytes'


def test_a_step_that_gathers_its_new_weights_compiles_them_uncombined_on_a_gpu():
  """ZeRO-1/2's post-update gathers alone on a GPU ('gpu': what jax's devices of one report),
  whether XLA_FLAGS holds nothing of the flag or the training default that `apply` and the
  target's `prepare` wrote there."""
  for flags in ('', xla_flags.merged('')[0]):
    assert xla_flags.step_options('gpu', True, {'XLA_FLAGS': flags}) == {COMBINE: '1'}


@pytest.mark.parametrize('platform, gathers', [('cpu', True), ('tpu', True), ('cuda', True),
                                              ('gpu', False)])
def test_no_step_option_off_the_gpu_or_where_no_new_weight_is_gathered(platform, gathers):
  assert xla_flags.step_options(platform, gathers, {'XLA_FLAGS': ''}) == {}


def test_a_combine_threshold_of_the_users_own_is_kept():
  environ = {'XLA_FLAGS': xla_flags.merged(f'--{COMBINE}=1048576')[0]}
  assert xla_flags.step_options('gpu', True, environ) == {}


def test_only_zero_1_and_2_gather_their_new_weights():
  from parallel.rules import ZERO_STAGES, layout_rules
  assert [layout_rules(z).gathers_new_weights for z in ZERO_STAGES] == [False, True, True, False]
