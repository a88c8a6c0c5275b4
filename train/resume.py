"""Where a workdir's run stands before anything is compiled or written: finished (a requeued or
retried job: nothing to do), finished but asked for more steps (it continues), or asked for fewer
steps than it has already trained (refused)."""
import json
import os

from train.checkpoint import CheckpointError
from train.metrics import read_rows
from train.validation import describe


def finished_evaluation(workdir: str, newest: int, steps: int) -> dict | None:
  """The recorded final evaluation when the newest checkpoint is at `steps` (train.steps) and its
  evaluation is in metrics.jsonl: the run is complete. None when there is training (or the final
  evaluation) left to do. CheckpointError when the newest checkpoint is past `steps`."""
  if newest > steps:
    raise CheckpointError(
        f'the newest checkpoint in {workdir} is at step {newest}, past train.steps={steps}; '
        f'give train.steps={newest} or more to continue that run, or use a fresh --workdir')
  if newest < steps:
    return None
  rows = read_rows(os.path.join(workdir, 'metrics.jsonl'))
  final = [row for row in rows if row.get('step') == steps and 'eval_loss' in row]
  if not final:
    return None
  return {k: v for k, v in final[-1].items() if k.startswith('eval_')}


def completion_line(workdir: str, step: int, evaluation: dict) -> str:
  figures = (describe(evaluation) if 'eval_loss_sem' in evaluation
             else f'loss {evaluation["eval_loss"]:.4f} nats/token')
  return f'run {workdir} is complete at step {step} (eval {figures}); nothing to do'


def continuation_line(workdir: str, newest: int, steps: int) -> str | None:
  """A line for a finished run given more steps (its saved config.json's train.steps is the
  newest checkpoint's step), else None."""
  try:
    with open(os.path.join(workdir, 'config.json'), encoding='utf-8') as f:
      saved = json.load(f)['train']['steps']
  except (OSError, ValueError, KeyError, TypeError):
    return None
  if saved != newest or steps <= newest:
    return None
  return (f'continuing  the run finished at step {newest} to train.steps={steps}; the learning '
          f'rate follows the schedule for {steps} steps from step {newest} on')
