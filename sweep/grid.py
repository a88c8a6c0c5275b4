"""The points of a sweep: each is a set of labels (what the point is called, the columns of the
results) and the config overrides that make it. Sweep files build them with four helpers:

  axis('train.seed', [0, 1, 2])                      # one key, one label per value (seed=0, ...)
  choices('layout', {'ddp': {...}, 'zero3': {...}})  # one label, several keys per value
  product(a, b, ...)                                 # every combination
  zipped(a, b, ...)                                  # the i-th of each together

An override key is a dotted config key (`train.seed`, `mesh.fsdp`), or `config` (the config file
and preset, `configs/fsdp.py:7b`), `target` (with command `plan` or `dry_run`: `--target`; a dry run
then compiles for that GPU with XLA:GPU), or `bench_steps` / `bench_warmup` /
`bench_matmul_size` (with command `bench`: bench.train_step's `--steps` / `--warmup` /
`--matmul_size`, the side of the matmul its MFU is measured against).
"""
import dataclasses
import itertools
import re

# Override keys that are command-line flags, not config keys: key -> the flag it sets.
FLAG_KEYS = {'config': '--config', 'target': '--target', 'bench_steps': '--steps',
             'bench_warmup': '--warmup', 'bench_matmul_size': '--matmul_size'}


class SweepError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Point:
  labels: dict       # label -> value: the point's name and its columns in the results
  overrides: dict    # dotted config key (or a FLAG_KEYS key) -> value

  @property
  def name(self) -> str:
    """The point's workdir name, from its labels: `model=7b_devices=64_layout=zero3`."""
    text = '_'.join(f'{k}={v}' for k, v in self.labels.items()) or 'base'
    return re.sub(r'[^A-Za-z0-9_.=+-]', '-', text)


def flatten(overrides: dict, prefix: str = '') -> dict:
  """{'mesh': {'fsdp': -1}} -> {'mesh.fsdp': -1}: every override is one dotted key."""
  out = {}
  for key, value in overrides.items():
    if isinstance(value, dict):
      out.update(flatten(value, f'{prefix}{key}.'))
    else:
      out[f'{prefix}{key}'] = value
  return out


def axis(key: str, values, label: str | None = None) -> list[Point]:
  """One point per value of `key`; labelled `label` (default: the key's last part; '' for no
  label, when another axis zipped with this one already names the point)."""
  label = key.rsplit('.', 1)[-1] if label is None else label
  values = list(values)
  if not values:
    raise SweepError(f'axis({key!r}) has no values')
  return [Point({label: v} if label else {}, {key: v}) for v in values]


def choices(label: str, options: dict) -> list[Point]:
  """One point per named option, each a dict of overrides: `choices('layout', {'ddp': {...}})`."""
  if not options:
    raise SweepError(f'choices({label!r}) has no options')
  return [Point({label: name}, flatten(overrides)) for name, overrides in options.items()]


def _merge(points: tuple[Point, ...]) -> Point:
  labels, overrides = {}, {}
  for p in points:
    for k, v in p.labels.items():
      if k in labels and labels[k] != v:
        raise SweepError(f'label {k!r} is {labels[k]!r} and {v!r} in one point; give the axes '
                         f'different labels')
      labels[k] = v
    for k, v in p.overrides.items():
      if k in overrides and overrides[k] != v:
        raise SweepError(f'override {k} is {overrides[k]!r} and {v!r} in one point '
                         f'({", ".join(f"{a}={b}" for a, b in labels.items())})')
      overrides[k] = v
  return Point(labels, overrides)


def product(*axes: list[Point]) -> list[Point]:
  """Every combination of the axes' points, the first axis outermost."""
  return [_merge(combo) for combo in itertools.product(*axes)]


def zipped(*axes: list[Point]) -> list[Point]:
  """The i-th point of every axis together; the axes must be equally long."""
  lengths = sorted({len(a) for a in axes})
  if len(lengths) > 1:
    raise SweepError(f'zipped axes have different lengths {lengths}; zip axes of one length')
  return [_merge(combo) for combo in zip(*axes)]


def check_names(points: list[Point]) -> None:
  """Each point's workdir is named from its labels, so two points may not share labels."""
  seen = {}
  for p in points:
    if p.name in seen and seen[p.name] != p.overrides:
      raise SweepError(f'two points are both named {p.name!r} (overrides {seen[p.name]} and '
                       f'{p.overrides}); label the axis that tells them apart')
    if p.name in seen:
      raise SweepError(f'point {p.name!r} is in the grid twice')
    seen[p.name] = p.overrides
