"""A sweep's results, one row per point of the grid: `results.csv` (every value at full precision,
and the point's config and overrides), `results.md` (the table with units, the failures with their
last error line, the charts) and the charts the sweep file declares. Each file is written whole under a temporary name and renamed, so a
reader never sees half of one."""
import csv
import io
import math
import os

from sweep.charts import draw
from sweep.metrics import METRICS, PointFiles
from sweep.runner import LOG_FILE, point_workdir, read_status
from sweep.spec import Sweep, config_of
from train.imports import tensorboardx


def rows(sweep: Sweep, directory: str) -> list[dict]:
  """Labels, status, error and each metric of every point (metrics empty unless it finished)."""
  out = []
  for point in sweep.points:
    workdir = point_workdir(directory, point)
    record = read_status(workdir) or {'status': 'not run'}
    config, overrides = sweep.settings(point)
    row = {**point.labels, 'status': record['status'], 'error': record.get('error', ''),
           'overrides': ' '.join(f'{k}={v}' for k, v in {'config': config, **overrides}.items())}
    files = PointFiles(workdir, sweep.target, config_of(sweep, point))
    for name in sweep.metrics:
      row[name] = METRICS[name].read(files) if record['status'] == 'done' else None
    row['wall_s'] = record.get('wall_s')
    out.append(row)
  return out


def _write(path: str, text: str) -> None:
  with open(path + '.tmp', 'w', encoding='utf-8') as f:
    f.write(text)
  os.replace(path + '.tmp', path)


def _columns(sweep: Sweep) -> list[str]:
  return [*sweep.labels, 'status', *[m for m in sweep.metrics if m != 'wall_s'], 'wall_s']


def csv_text(sweep: Sweep, table: list[dict]) -> str:
  buffer = io.StringIO()
  writer = csv.DictWriter(buffer, fieldnames=[*_columns(sweep), 'error', 'overrides'],
                          lineterminator='\n')
  writer.writeheader()
  for row in table:
    writer.writerow({k: '' if row.get(k) is None else row[k] for k in writer.fieldnames})
  return buffer.getvalue()


def _cell(name: str, value) -> str:
  if value is None:
    return ''
  if isinstance(value, float):
    if math.isnan(value):
      return 'nan'
    digits = METRICS[name].digits if name in METRICS else 3
    return f'{value:,.{digits}f}'
  return str(value)


def markdown(sweep: Sweep, table: list[dict], command: str, charts: list[str]) -> str:
  columns = _columns(sweep)
  headers = [METRICS[c].header if c in METRICS else c for c in columns]
  lines = [f'# {sweep.title}', '', f'`{command}`', '',
           f'Each point: `{sweep.command}` of `{sweep.config}` with its overrides, in its own '
           f'process and workdir (`runs/<point>/`, with `{LOG_FILE}`).', '',
           '| ' + ' | '.join(headers) + ' |',
           '|' + '|'.join('---:' if any(isinstance(r.get(c), (int, float)) for r in table)
                          else '---' for c in columns) + '|']
  for row in table:
    lines.append('| ' + ' | '.join(_cell(c, row.get(c)) for c in columns) + ' |')
  notes = []
  if any(m.startswith('modelled_') for m in sweep.metrics):
    notes.append(f'`modelled_*` columns are the planner\'s cost model (plan/cost.py) for the '
                 f'point\'s recipe on {sweep.target} GPUs: estimates, not measurements.')
  if 'mfu' in sweep.metrics:
    notes.append('MFU: a bench point\'s is against the matmul rate measured in the same run; a '
                 'training point\'s against its device\'s datasheet bf16 dense peak '
                 '(configs/hardware.py), empty where the device has none (a CPU).')
  if 'mfu_peak' in sweep.metrics:
    notes.append('MFU of the datasheet peak: model FLOPs (6 per matmul weight, 4 with a frozen '
                 'LoRA base, plus attention; not what remat recomputes) against the device\'s '
                 'dense bf16 peak (configs/hardware.py), for fp8 and int8 matmuls too; empty on a '
                 'device without one (a CPU).')
  if any(m in sweep.metrics for m in ('modelled_vs_measured', 'calibrated_mfu')):
    notes.append(f'"Modelled ÷ measured" and "MFU the cost model would need" compare the cost '
                 f'model with the point\'s measured step only where the point ran on {sweep.target}; '
                 f'the cost model assumes one MFU for every recipe (plan/cost.py MFU_ASSUMED).')
  if 'peak_vs_estimate' in sweep.metrics:
    notes.append('"Peak" is the allocator\'s peak bytes in use on device 0 over the whole process '
                 '(initialisation and compilation included), against the analytic estimate on a '
                 'GPU; empty where the device does not report it (a CPU).')
  if any(m in sweep.metrics for m in ('compiled_gb', 'estimate_gb', 'estimate_gpu_gb')):
    from importlib.metadata import version
    notes.append(f'GB = 1e9 bytes. "Compiled" is XLA\'s memory analysis of the compiled step on '
                 f'this machine\'s backend (jax {version("jax")}, jaxlib {version("jaxlib")}); '
                 f'"estimate on a GPU" the analytic model without XLA:CPU\'s fp32 copies of bf16 '
                 f'matmul operands.')
  if notes:
    lines += [''] + [f'- {n}' for n in notes]
  name = lambda r: '_'.join(f'{k}={r[k]}' for k in sweep.labels if k in r)
  unfinished = [r for r in table if r['status'] not in ('done', 'not run')]
  not_run = [r for r in table if r['status'] == 'not run']
  if unfinished or not_run:
    lines += ['', '## Not finished', '']
    lines += [f'- `{name(r)}`: {r["status"]}' + (f': {r["error"]}' if r.get('error') else '')
              for r in unfinished]
    if not_run:
      lines.append(f'- not run in this directory ({len(not_run)}): '
                   + ', '.join(f'`{name(r)}`' for r in not_run))
  if charts:
    lines += ['', '## Charts', ''] + [f'![{os.path.basename(c)}]({os.path.basename(c)})'
                                       for c in charts]
  return '\n'.join(lines) + '\n'


def write_tensorboard(sweep: Sweep, table: list[dict], directory: str) -> None:
  """TensorBoard's hparams view over the points: one run per finished point, under
  DIR/tensorboard (rewritten whole each time)."""
  import shutil

  SummaryWriter = tensorboardx().SummaryWriter
  root = os.path.join(directory, 'tensorboard')
  staging = root + '.tmp'
  shutil.rmtree(staging, ignore_errors=True)
  for row in table:
    if row['status'] != 'done':
      continue
    values = {f'sweep/{m}': row[m] for m in sweep.metrics if isinstance(row.get(m), (int, float))
              and not isinstance(row[m], bool)}
    hparams = {k: row[k] for k in sweep.labels if k in row}
    name = '_'.join(f'{k}={v}' for k, v in hparams.items()) or 'base'
    with SummaryWriter(os.path.join(staging, name)) as writer:
      writer.add_hparams(hparams, values, name='.')
  shutil.rmtree(root, ignore_errors=True)
  if os.path.isdir(staging):
    os.replace(staging, root)


def write(sweep: Sweep, directory: str, command: str) -> list[dict]:
  table = rows(sweep, directory)
  charts = [path for path in (draw(chart, [r for r in table if r['status'] == 'done'], directory)
                              for chart in sweep.charts) if path]
  _write(os.path.join(directory, 'results.csv'), csv_text(sweep, table))
  _write(os.path.join(directory, 'results.md'), markdown(sweep, table, command, charts))
  write_tensorboard(sweep, table, directory)
  return table
