"""A sweep file (`sweeps/NAME.py[:arg]`), loaded and checked whole before anything runs.

`get_sweep(arg=None)` returns a dict of:
  title      what the sweep asks (the heading of results.md)
  command    what runs per point: train | dry_run | plan | bench (bench.train_step)
  config     the base config file and preset, `configs/default.py[:preset]`
  overrides  dotted config keys set for every point (a point's own overrides win)
  points     the grid (sweep/grid.py: axis, choices, product, zipped)
  metrics    the columns to collect (sweep/metrics.py), in order
  charts     PNG charts to draw (sweep/charts.py: CHART_KEYS)
  target     optional: the GPU (configs/hardware.py) the modelled metrics and a chart's memory
             line refer to; default H100-80GB
  before     optional: runs made once before the grid, {name: overrides}; a string override of a
             point may name one's workdir as `{name}` (e.g. `init_from='run:{base}'`)
"""
import dataclasses
import importlib.util
import os
import re

import configs
from sweep.grid import FLAG_KEYS, Point, SweepError, check_names, flatten

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ('train', 'dry_run', 'plan', 'bench')
SWEEP_KEYS = ('title', 'command', 'config', 'overrides', 'points', 'metrics', 'charts', 'target',
              'before')
REQUIRED = ('title', 'command', 'config', 'points', 'metrics')


@dataclasses.dataclass
class Sweep:
  path: str
  title: str
  command: str
  config: str
  overrides: dict
  points: list
  metrics: tuple
  charts: tuple
  target: str
  before: dict       # name -> Point (labels {'before': name})

  def settings(self, point: Point) -> tuple[str, dict]:
    """(config file spec, overrides) of a point: the sweep's overrides, then the point's."""
    before = 'before' in point.labels   # a before run is its own overrides only
    overrides = {**({} if before else self.overrides), **point.overrides}
    return overrides.pop('config', self.config), overrides

  @property
  def labels(self) -> list[str]:
    """Every label of the grid, in first-seen order: the results' leading columns."""
    seen = {}
    for p in self.points:
      seen.update(dict.fromkeys(p.labels))
    return list(seen)


def project_path(path: str) -> str:
  """`path` as given, or under the project root (sweep and config files name `configs/x.py`)."""
  if os.path.exists(path) or os.path.isabs(path):
    return path
  return os.path.join(ROOT, path)


def load(spec: str) -> Sweep:
  """The sweep `path[:arg]` names, checked: SweepError in one line for anything wrong with it."""
  path, _, arg = spec.partition(':')
  full = project_path(path)
  if not os.path.isfile(full):
    known = sorted(f'sweeps/{f}' for f in os.listdir(os.path.join(ROOT, 'sweeps'))
                   if f.endswith('.py') and not f.startswith('_'))
    raise SweepError(f'--sweep={spec}: no such sweep file; known: {", ".join(known)}')
  module_spec = importlib.util.spec_from_file_location('_sweep_file', full)
  module = importlib.util.module_from_spec(module_spec)
  try:
    module_spec.loader.exec_module(module)
    if not hasattr(module, 'get_sweep'):
      raise SweepError(f'{path} has no get_sweep(); a sweep file defines get_sweep(arg=None)')
    raw = module.get_sweep(arg) if arg else module.get_sweep()
  except SweepError:
    raise
  except Exception as e:   # the file's own mistake, in one line rather than a traceback
    raise SweepError(f'{path}: {type(e).__name__}: {e}') from None
  if not isinstance(raw, dict):
    raise SweepError(f'{path}: get_sweep() returned {type(raw).__name__}; it returns a dict')
  unknown = sorted(set(raw) - set(SWEEP_KEYS))
  if unknown:
    raise SweepError(f'{path}: unknown sweep key {unknown[0]!r}; allowed: {", ".join(SWEEP_KEYS)}')
  missing = [k for k in REQUIRED if k not in raw]
  if missing:
    raise SweepError(f'{path}: missing sweep key {missing[0]!r} (required: {", ".join(REQUIRED)})')
  if raw['command'] not in COMMANDS:
    raise SweepError(f'{path}: command={raw["command"]!r}; allowed: {", ".join(COMMANDS)}')
  points = raw['points']
  if not isinstance(points, list) or not points:
    raise SweepError(f'{path}: the grid is empty; points must list at least one point '
                     f'(sweep/grid.py: axis, choices, product, zipped)')
  if not all(isinstance(p, Point) for p in points):
    raise SweepError(f'{path}: points must be made with sweep/grid.py (axis, choices, product, '
                     f'zipped)')
  check_names(points)
  from configs.hardware import GPUS
  target = raw.get('target', 'H100-80GB')
  if target not in GPUS:
    raise SweepError(f'{path}: target={target!r}; known: {", ".join(GPUS)}')
  before = {}
  for name, overrides in raw.get('before', {}).items():
    if not re.fullmatch(r'\w+', name):
      raise SweepError(f'{path}: before run {name!r}; its name is letters, digits and _')
    before[name] = Point({'before': name}, flatten(overrides))
  from sweep.metrics import METRICS
  metrics = tuple(raw['metrics'])
  for m in metrics:
    if m not in METRICS:
      raise SweepError(f'{path}: unknown metric {m!r}; known: {", ".join(METRICS)}')
  sweep = Sweep(full, raw['title'], raw['command'], raw['config'], dict(raw.get('overrides', {})),
                points, metrics, tuple(raw.get('charts', ())), target, before)
  from sweep.charts import check_chart
  for chart in sweep.charts:
    check_chart(chart, sweep.labels, metrics)
  return sweep


def config_of(sweep: Sweep, point: Point):
  """The point's config as its run will see it; SweepError naming the point and the key."""
  spec, overrides = sweep.settings(point)
  path = spec.partition(':')[0]
  if not os.path.isfile(project_path(path)):
    raise SweepError(f'point {point.name}: config={spec!r}: no such config file')
  try:
    config = configs.load(project_path(path) + spec[len(path):])
  except ValueError as e:
    raise SweepError(f'point {point.name}: config={spec!r}: {e}') from None
  for key, value in overrides.items():
    if key in FLAG_KEYS:
      continue
    if not isinstance(value, (bool, int, float, str)):
      raise SweepError(f'point {point.name}: {key}={value!r}; an override is a number, a string '
                       f'or a boolean')
    *parents, leaf = key.split('.')
    node = config
    for depth, part in enumerate(parents + [leaf]):
      if not hasattr(node, 'keys') or part not in node:
        where = '.'.join(key.split('.')[:depth]) or 'the config'
        known = ', '.join(sorted(node.keys())) if hasattr(node, 'keys') else 'none'
        raise SweepError(f'point {point.name}: unknown config key {key!r}; keys of {where}: {known}')
      if depth < len(parents):
        node = node[part]
    try:
      node[leaf] = value
    except (TypeError, ValueError) as e:
      raise SweepError(f'point {point.name}: {key}={value!r}: {e}') from None
  return config


def check(sweep: Sweep) -> None:
  """Every point's config through the checks a run makes before it compiles (train/checks.py),
  on the devices it will have; SweepError naming the first point refused."""
  import jax

  from data import DataError
  from data.prepare import open_tokenizer
  from parallel.mesh import resolve_mesh_shape
  from train import checks
  errors = (checks.ConfigError, DataError, ValueError)   # plan.target's TargetError is a ValueError
  for point in [*sweep.before.values(), *sweep.points]:
    config = config_of(sweep, point)
    command = 'train' if point.labels.get('before') else sweep.command
    for key, least in (('bench_steps', 1), ('bench_warmup', 0), ('bench_matmul_size', 1)):
      value = sweep.settings(point)[1].get(key)
      if value is not None and (command != 'bench' or isinstance(value, bool)
                                or not isinstance(value, int) or value < least):
        raise SweepError(f'point {point.name}: {key}={value!r}; it is a whole number (steps and '
                         f'the matmul size at least 1, warm-up at least 0) for command bench only')
    target = sweep.settings(point)[1].get('target')
    if target is not None and command not in ('plan', 'dry_run'):
      raise SweepError(f'point {point.name}: target={target!r} goes with command plan or dry_run '
                       f'only (this sweep runs {command})')
    try:
      from plan.target import parse_target
      checks.model_spec(config, platform='gpu' if target else None)
      if command == 'plan':
        parse_target(target)
        continue
      cpu = jax.default_backend() == 'cpu'
      devices = (parse_target(target).count if target else
                 (config.get('host_devices') or 1) if cpu else jax.device_count())
      shape = resolve_mesh_shape(config.mesh.to_dict(), devices)
      data_parallel = shape['data'] * shape['fsdp']
      checks.check_config(config, data_parallel=data_parallel, process_count=1,
                          tokenizer_vocab=open_tokenizer(config.data.tokenizer).vocab_size,
                          context=shape['context'])
      checks.pipeline_schedule(config, stages=shape['stage'], data_parallel=data_parallel)
    except errors as e:
      raise SweepError(f'point {point.name}: {e}') from None
    source = config.init_from
    if source.startswith('run:') and not re.search(r'\{\w+\}', source) \
        and not os.path.isdir(os.path.expanduser(source[4:])):
      raise SweepError(f'point {point.name}: init_from={source!r}: no such run directory')
