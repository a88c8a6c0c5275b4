"""Train, dry-run or size a language model from a config file.

  python main.py --config=configs/default.py[:preset] [--config.key=value ...] [--workdir=DIR]
                 [--host_devices=N] [--dry_run]
                 [--coordinator_address=H:P --num_processes=N --process_id=I]
"""
import datetime
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Experiment config file[:preset].')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default: a fresh folder under runs/. '
                               'Re-using one resumes from its latest checkpoint.')
_HOST_DEVICES = flags.DEFINE_integer('host_devices', None, 'With no accelerator, simulate N CPU devices.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Compile the train step, report its memory, run nothing.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'Multi-host: host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Multi-host: number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'Multi-host: this process\'s index.')


def _init_jax() -> None:
  """Device simulation and multi-host set-up; both must happen before JAX touches a backend."""
  import jax
  if _HOST_DEVICES.value:
    if _HOST_DEVICES.value < 1:
      sys.exit(f'error: --host_devices={_HOST_DEVICES.value}; it must be a positive integer')
    jax.config.update('jax_num_cpu_devices', _HOST_DEVICES.value)
  if _COORDINATOR.value or _NUM_PROCESSES.value:
    jax.distributed.initialize(coordinator_address=_COORDINATOR.value,
                               num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value)


def _default_workdir(config_name: str) -> str:
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return os.path.join('runs', f'{config_name.replace(":", "-")}-{stamp}')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]}; config values are set as --config.key=value')
  logging.set_verbosity(logging.WARNING)  # orbax narrates every save at INFO
  _init_jax()
  from data import DataError
  from train import checks, run
  from train.checkpoint import CheckpointError

  config = _CONFIG.value
  workdir = _WORKDIR.value or _default_workdir(config.name)
  try:
    if _DRY_RUN.value:
      run.dry_run(config, workdir)
    else:
      run.train_and_evaluate(config, workdir)
  except (checks.ConfigError, DataError, CheckpointError) as e:
    sys.exit(f'error: {e}')
  print(f'outputs     {os.path.abspath(workdir)}')


if __name__ == '__main__':
  app.run(main)
