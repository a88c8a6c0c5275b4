"""One table row per fine-tuning run or dry run: what trains, the frozen base's bytes, and the
compiled train step's per-device memory beside the analytic estimate (for the CPU it was compiled
on, and for a GPU: the same model without XLA:CPU's fp32 copies); for runs that trained, the
validation loss before and after.

  python -m bench.studies.finetune runs/ft-7b-full-z3 runs/ft-7b-lora-z3 runs/ft-7b-qlora-z3 ...
"""
import json
import os
import sys

from train.metrics import read_rows

GIB = 1024**3


def _read(workdir: str, name: str):
  path = os.path.join(workdir, name)
  if not os.path.isfile(path):
    return None
  if name.endswith('.jsonl'):
    return read_rows(path)
  with open(path) as f:
    return json.load(f)


def row(workdir: str) -> dict:
  memory = _read(workdir, 'memory.json')
  if memory is None:
    raise SystemExit(f'error: {workdir}/memory.json does not exist; run or dry-run there first')
  compiled, estimate = memory['per_device_bytes'], memory['estimate_bytes']
  out = {
      'run': os.path.basename(os.path.normpath(workdir)),
      'devices': 'x'.join(str(v) for v in memory['mesh'].values()),
      'params_M': memory['num_params'] / 1e6,
      'trainable_M': memory.get('trainable_params', memory['num_params']) / 1e6,
      'frozen_GiB': memory.get('frozen_bytes', 0) / GIB,
      'arguments_GiB': compiled['arguments'] / GIB,
      'temp_GiB': compiled['temp'] / GIB,
      'compiled_GiB': compiled['total'] / GIB,
      'estimate_GiB': estimate['total'] / GIB,
      'gpu_estimate_GiB': memory.get('estimate_gpu_bytes', {}).get('total', 0) / GIB,
  }
  metrics = _read(workdir, 'metrics.jsonl')
  if metrics:
    evals = [r for r in metrics if 'eval_loss' in r]
    out['eval_first'], out['eval_last'] = evals[0]['eval_loss'], evals[-1]['eval_loss']
    out['steps'] = evals[-1]['step']
  return out


def main(workdirs: list[str]) -> None:
  if not workdirs:
    raise SystemExit(__doc__)
  rows = [row(w) for w in workdirs]
  columns = list(dict.fromkeys(k for r in rows for k in r))
  print('| ' + ' | '.join(columns) + ' |')
  print('|' + '---|' * len(columns))
  for r in rows:
    cells = [f'{r[c]:.4f}' if isinstance(r.get(c), float) and c.startswith('eval')
             else f'{r[c]:.3f}' if isinstance(r.get(c), float) else str(r.get(c, ''))
             for c in columns]
    print('| ' + ' | '.join(cells) + ' |')


if __name__ == '__main__':
  main(sys.argv[1:])
