"""Validation: nats per predicted token, bits per byte and perplexity, each with the standard error
of its mean; the run's evaluator; and `python -m train.evaluate`, which scores a run's newest
checkpoint on any prepared data.

  python -m train.evaluate --workdir=W [--data.path=DIR_OR_GLOB] [--eval_tokens=N] [--host_devices=N]

The evaluation set is fixed (data/pipeline.py: windows spread over the held-out documents) and run
in one jitted loop over its batches. The standard error treats windows as the samples (the tokens
of one window are not independent): with window i's summed loss s_i over its c_i predicted tokens
and the mean m = sum(s) / sum(c), SEM = sqrt(sum((s_i - m c_i)^2) / (n (n - 1))) / mean(c), the
ratio estimator's; with equal c_i it is the familiar std(window means) / sqrt(n).
"""
import argparse
import json
import math
import os
import sys

import jax
import ml_collections
import numpy as np
from tqdm import tqdm

from data import DataError

from parallel.sharding import replicated
from train.step import token_losses


def make_eval_loop(graphdef, stack=None):
  """eval_loop(params, frozen, batches) -> (summed loss, predicted targets), each
  [batches, rows]: `batches` holds arrays [batches, rows, length]; frozen is the LoRA base ({}
  without LoRA); `stack`: how the blocks run (the train step's pipeline)."""
  def eval_loop(params, frozen, batches):
    def one_batch(_, batch):
      losses = token_losses(graphdef, params, frozen, batch, stack=stack)
      return None, (losses.sum(-1), (batch['targets'] >= 0).sum(-1))
    return jax.lax.scan(one_batch, None, batches)[1]
  return eval_loop


def figures(sums, counts, bytes_per_token: float) -> dict:
  """The evaluation's figures from each window's summed loss and its predicted targets."""
  sums = np.asarray(sums, np.float64).reshape(-1)
  counts = np.asarray(counts, np.float64).reshape(-1)
  sums, counts = sums[counts > 0], counts[counts > 0]
  n = len(counts)
  nats = float(sums.sum() / counts.sum())
  sem = (float(np.sqrt(((sums - nats * counts) ** 2).sum() / (n * (n - 1))) / counts.mean())
         if n > 1 else float('nan'))
  per_bit = 1 / math.log(2) / bytes_per_token
  return {'eval_loss': nats, 'eval_loss_sem': sem,
          'eval_bits_per_byte': nats * per_bit, 'eval_bits_per_byte_sem': sem * per_bit,
          'eval_perplexity': math.exp(nats), 'eval_tokens': int(counts.sum()), 'eval_windows': n}


def describe(result: dict) -> str:
  return (f'loss {result["eval_loss"]:.4f} ± {result["eval_loss_sem"]:.4f} nats/token, '
          f'{result["eval_bits_per_byte"]:.4f} ± {result["eval_bits_per_byte_sem"]:.4f} bits/byte, '
          f'perplexity {result["eval_perplexity"]:.2f} (± one standard error, '
          f'{result["eval_tokens"]:,} tokens in {result["eval_windows"]} windows)')


class Evaluator:
  """The run's validation: one jitted loop over the fixed evaluation set, placed like the state,
  and one printed line per evaluation (main process). `evaluator(state, step)` returns the figures."""

  def __init__(self, s, batches: dict, bytes_per_token: float):
    self._context = s.context
    self._batches = batches
    self._bytes_per_token = bytes_per_token
    with s.context():
      self._loop = jax.jit(make_eval_loop(s.layout.graphdef, s.stack),
                           in_shardings=(s.layout.shardings['params'],
                                         s.layout.shardings.get('frozen', {}),
                                         {k: v.sharding for k, v in batches.items()}),
                           out_shardings=replicated(s.mesh))

  def __call__(self, state: dict, step: int) -> dict:
    with self._context():
      sums, counts = jax.device_get(self._loop(state['params'], state.get('frozen', {}),
                                               self._batches))
    result = figures(sums, counts, self._bytes_per_token)
    if jax.process_index() == 0:
      tqdm.write(f'eval  step {step}: {describe(result)}')
    return result


def evaluate_workdir(workdir: str, data_path: str | None = None,
                     eval_tokens: int | None = None) -> dict:
  """Scores the newest checkpoint of the run in `workdir` on the validation split of `data_path`
  (default: the run's own data); appends the figures to WORKDIR/evaluations.jsonl."""
  from train import run   # run imports this module's Evaluator: imported here, not at the top

  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise DataError(f'--workdir={workdir!r} holds no config.json: give the directory of a run')
  with open(path, encoding='utf-8') as f:
    config = ml_collections.ConfigDict(json.load(f))
  if data_path is not None:
    config.data.path = data_path
  if eval_tokens is not None:
    config.train.eval_tokens = eval_tokens
  checkpoints = run._open_checkpoints(config, workdir)
  if checkpoints is None or not checkpoints.steps():
    raise DataError(f'--workdir={workdir!r} holds no checkpoint to evaluate')
  s = run.setup(config, stored_block_axes=run._stored_block_axes(checkpoints))
  run.data_source.check_path(config.data.path, config.data.tokenizer)
  restored = checkpoints.restore_newest(s.layout.abstract)
  prepared = run.open_data(config, workdir)
  evaluator = Evaluator(s, run.eval_set(s, prepared), prepared.bytes_per_token('val'))
  result = {'step': restored.step, 'data': prepared.directory, **evaluator(restored.state,
                                                                            restored.step)}
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
