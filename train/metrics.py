"""Metrics to `metrics.jsonl` (one JSON object per logged step) and TensorBoard event files.

A run that starts again (a resume, or a fresh start over a run that died before its first
checkpoint) first cuts both back to the rows it will not log again: the steps before the one it
starts from. Steps after the checkpoint are trained again and logged again; keeping their old rows
would give every such step twice.
"""
import json
import os
import struct

from train.imports import tensorboardx


class MetricsWriter:
  """Writes only on the main process; other processes get a writer that does nothing.
  `keep_before`: rows (and TensorBoard scalars) of steps >= this already on disk are removed first."""

  def __init__(self, workdir: str, *, enabled: bool = True, keep_before: int = 0):
    self.enabled = enabled
    self._path = os.path.join(workdir, 'metrics.jsonl')
    self._events = os.path.join(workdir, 'tensorboard')
    if enabled:
      self._open(keep_before)

  def _open(self, keep_before: int) -> None:
    truncate_jsonl(self._path, keep_before)
    truncate_events(self._events, keep_before)
    self._jsonl = open(self._path, 'a', encoding='utf-8')
    self._tensorboard = tensorboardx().SummaryWriter(self._events)

  def rewrite(self, step: int, values: dict) -> None:
    """Write `step`'s row again, whole, in place of the last one logged (it must be the last):
    the old row stays until the new one is ready to replace it."""
    if not self.enabled:
      return
    self.close()
    self._open(keep_before=step)
    self.write(step, values)

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


def read_rows(path: str) -> list[dict]:
  """metrics.jsonl's rows; a torn line (a process killed mid-write), or one that is not a row, is
  left out."""
  if not os.path.exists(path):
    return []
  rows = []
  with open(path, encoding='utf-8', errors='replace') as f:
    for line in f:
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        continue
      if isinstance(row, dict):
        rows.append(row)
  return rows


def truncate_jsonl(path: str, keep_before: int) -> None:
  """Keep the rows of steps < keep_before (the file is replaced whole, atomically)."""
  if not os.path.exists(path):
    return
  with open(path, encoding='utf-8') as f:
    lines = f.readlines()
  kept = [line for line in lines if _row_step(line) is not None and _row_step(line) < keep_before]
  if len(kept) != len(lines) or (lines and not lines[-1].endswith('\n')):
    _replace(path, ''.join(line if line.endswith('\n') else line + '\n' for line in kept).encode())


def _row_step(line: str) -> int | None:
  try:
    return int(json.loads(line)['step'])
  except (json.JSONDecodeError, KeyError, TypeError, ValueError):
    return None


def truncate_events(directory: str, keep_before: int) -> None:
  """Drop every summary of a step >= keep_before from the TensorBoard event files in `directory`;
  other records are kept as they are. A torn last record is dropped too."""
  for path in event_files(directory):
    with open(path, 'rb') as f:
      size = len(f.read())
    kept = [raw for raw, event in event_records(path)
            if not (event.HasField('summary') and event.step >= keep_before)]
    if sum(map(len, kept)) != size:
      _replace(path, b''.join(kept))


def event_files(directory: str) -> list[str]:
  if not os.path.isdir(directory):
    return []
  return [os.path.join(directory, name) for name in sorted(os.listdir(directory))
          if 'tfevents' in name]


def event_records(path: str) -> list[tuple[bytes, object]]:
  """An event file's records, each (its bytes, the Event): a TFRecord file of length, its CRC,
  the serialized Event, its CRC. Stops at a torn or undecodable record (a process killed while
  writing it)."""
  event_pb2 = tensorboardx('tensorboardX.proto.event_pb2')
  with open(path, 'rb') as f:
    data = f.read()
  records, offset = [], 0
  while offset + 12 <= len(data):
    (length,) = struct.unpack('<Q', data[offset:offset + 8])
    end = offset + 12 + length + 4
    if end > len(data):
      break
    try:
      event = event_pb2.Event.FromString(data[offset + 12:offset + 12 + length])
    except Exception:   # protobuf's DecodeError
      break
    records.append((data[offset:end], event))
    offset = end
  return records


def _replace(path: str, data: bytes) -> None:
  temporary = path + '.tmp'
  with open(temporary, 'wb') as f:
    f.write(data)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def _plain(value):
  if hasattr(value, 'item'):
    value = value.item()
  return value
