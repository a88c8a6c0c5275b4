"""`python -m cli.evaluate`: scores a run's newest checkpoint on any prepared data
(train/evaluate.py), prints the figures and appends them to WORKDIR/evaluations.jsonl.

  python -m cli.evaluate --workdir=W [--data.path=DIR_OR_GLOB] [--eval_tokens=N] [--host_devices=N]
"""
import argparse
import json
import os
import sys

import jax

from data import DataError


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m cli.evaluate',
                                   description="Evaluate a run's newest checkpoint.")
  parser.add_argument('--workdir', required=True, help='the run directory')
  parser.add_argument('--data.path', dest='data_path', default=None,
                      help="prepared directory or glob (default: the run's data.path)")
  parser.add_argument('--eval_tokens', type=int, default=None,
                      help="validation tokens (default: the run's train.eval_tokens)")
  parser.add_argument('--host_devices', type=int, default=None,
                      help='with no accelerator, simulate N CPU devices (default: the run\'s)')
  args = parser.parse_args(argv)
  config_path = os.path.join(args.workdir, 'config.json')
  host_devices = args.host_devices
  if host_devices is None and os.path.isfile(config_path):
    with open(config_path, encoding='utf-8') as f:
      host_devices = json.load(f).get('host_devices') or None
  if host_devices:
    jax.config.update('jax_num_cpu_devices', host_devices)
  # The library is imported once the device count is set.
  from train.checkpoint import CheckpointError
  from train.checks import ConfigError
  from train.evaluate import evaluate_workdir
  try:
    evaluate_workdir(args.workdir, args.data_path, args.eval_tokens)
  except (DataError, CheckpointError, ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
