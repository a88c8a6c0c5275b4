"""`python -m train.evaluate`: scores a run's newest checkpoint on any prepared data.

  python -m train.evaluate --workdir=W [--data.path=DIR_OR_GLOB] [--eval_tokens=N] [--host_devices=N]

The run's config (W/config.json) builds the model and its layout on this machine's devices; the
validation split of `--data.path` (default: the run's own data) is evaluated as the run evaluates
(train/validation.py), and the figures are printed and appended to W/evaluations.jsonl.
"""
import argparse
import json
import os
import sys

import jax

from configs import default
from data import DataError
from data import source as data_source
from train import ptq, run


def evaluate_workdir(workdir: str, data_path: str | None = None,
                     eval_tokens: int | None = None) -> dict:
  """Scores the newest checkpoint of the run in `workdir` on the validation split of `data_path`
  (default: the run's own data); appends the figures to WORKDIR/evaluations.jsonl."""
  # Laid over the defaults: a run saved before a key existed evaluates with its default.
  config = ptq.run_config(workdir, default.get_config())
  if data_path is not None:
    config.data.path = data_path
  if eval_tokens is not None:
    config.train.eval_tokens = eval_tokens
  checkpoints = run._open_checkpoints(config, workdir)
  if checkpoints is None or not checkpoints.steps():
    raise DataError(f'--workdir={workdir!r} holds no checkpoint to evaluate')
  s = run.setup(config, stored_block_axes=run._stored_block_axes(checkpoints))
  data_source.check_data(config.data)
  restored = checkpoints.restore_newest(s.layout.abstract, unpadded=s.layout.unpadded)
  sources = run.open_data(config, workdir)
  result = {'step': restored.step,
            'data': ','.join(prepared.directory for _, _, prepared in sources),
            **run.evaluator(s, sources)(restored.state, restored.step)}
  if jax.process_index() == 0:
    with open(os.path.join(workdir, 'evaluations.jsonl'), 'a', encoding='utf-8') as f:
      f.write(json.dumps(result, sort_keys=True) + '\n')
  return result


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m train.evaluate',
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
  from train.checkpoint import CheckpointError
  from train.checks import ConfigError
  try:
    evaluate_workdir(args.workdir, args.data_path, args.eval_tokens)
  except (DataError, CheckpointError, ConfigError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
