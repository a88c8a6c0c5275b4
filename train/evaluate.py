"""Scores a run's newest checkpoint on any prepared data (the program: `python -m cli.evaluate`).

The run's config (W/config.json) builds the model and its layout on this machine's devices; the
validation split of `--data.path` (default: the run's own data) is evaluated as the run evaluates
(train/validation.py), and the figures are printed and appended to W/evaluations.jsonl.
"""
import json
import os

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


if __name__ == '__main__':   # the old command; the program is cli/evaluate.py
  import runpy
  runpy.run_module('cli.evaluate', run_name='__main__', alter_sys=True)
