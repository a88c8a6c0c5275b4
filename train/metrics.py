"""Metrics to `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files."""
import json
import os

from tensorboardX import SummaryWriter


class MetricsWriter:
  """Writes only on the main process; other processes get a writer that does nothing."""

  def __init__(self, workdir: str, *, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      self._jsonl = open(os.path.join(workdir, 'metrics.jsonl'), 'a', encoding='utf-8')
      self._tensorboard = SummaryWriter(os.path.join(workdir, 'tensorboard'))

  def write(self, step: int, values: dict) -> None:
    if not self.enabled:
      return
    row = {'step': int(step), **{k: _plain(v) for k, v in values.items()}}
    self._jsonl.write(json.dumps(row) + '\n')
    self._jsonl.flush()
    for key, value in row.items():
      if key != 'step' and isinstance(value, (int, float)):
        self._tensorboard.add_scalar(key, value, step)

  def close(self) -> None:
    if self.enabled:
      self._jsonl.close()
      self._tensorboard.close()


def _plain(value):
  if hasattr(value, 'item'):
    value = value.item()
  return value
