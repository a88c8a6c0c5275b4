"""What a finished point measured, read back from the files its run left in its workdir
(`metrics.jsonl`, `memory.json`, `bench.json`, `plan.json`), the config it ran with, and the
sweep's own record of it (`sweep.json`). Each metric has a column header with its unit; a metric a point's
command does not produce is empty (None), never invented.

Modelled metrics (`modelled_*`) are the planner's cost model (plan/cost.py) applied to the point's
recipe on the sweep's `target` GPU: estimates, not measurements, and labelled so.
"""
import dataclasses
import json
import os
import statistics
from typing import Callable

from train.metrics import read_rows

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Metric:
  header: str                       # column header, with the unit
  read: Callable[['PointFiles'], object]
  digits: int = 3                   # decimals in results.md


class PointFiles:
  """A point's workdir, each file read once, None where the run did not write it."""

  def __init__(self, workdir: str, target: str, config):
    self.workdir, self.target, self.config = workdir, target, config   # the config it ran with
    self._cache = {}

  def json(self, name: str) -> dict | None:
    if name not in self._cache:
      path = os.path.join(self.workdir, name)
      try:
        with open(path, encoding='utf-8') as f:
          self._cache[name] = json.load(f)
      except (OSError, ValueError):
        self._cache[name] = None
    return self._cache[name]

  def rows(self) -> list[dict]:
    if 'rows' not in self._cache:   # a torn line (a run killed mid-write) is left out, not the rest
      self._cache['rows'] = read_rows(os.path.join(self.workdir, 'metrics.jsonl'))
    return self._cache['rows']

  def evals(self) -> list[dict]:
    return [r for r in self.rows() if 'eval_loss' in r]

  def memory(self, *keys):
    value = self.json('memory.json') or self.json('bench.json')   # a bench point writes memory's keys
    for key in keys:
      if not isinstance(value, dict) or key not in value:
        return None
      value = value[key]
    return value


def _final_eval(f: PointFiles, key: str):
  evals = f.evals()
  return evals[-1].get(key) if evals else None


def _best_loss(f: PointFiles):
  evals = f.evals()
  return min(r['eval_loss'] for r in evals) if evals else None


def _tokens_per_sec(f: PointFiles):
  bench = f.json('bench.json')
  if bench:
    return bench['tokens_per_sec']
  rates = [r['tokens_per_sec'] for r in f.rows() if 'tokens_per_sec' in r]
  return statistics.median(rates) if rates else None


def _devices(f: PointFiles) -> int | None:
  mesh = f.memory('mesh')
  if mesh:
    import math
    return math.prod(mesh.values())
  bench = f.json('bench.json')
  return bench['devices'] if bench else None


def _mfu(f: PointFiles):
  """bench points: against the matmul rate measured in the same run; train points: against the
  device's datasheet bf16 dense peak, when memory.json names a device that has one (a GPU)."""
  bench = f.json('bench.json')
  return bench['mfu'] if bench else _mfu_peak(f)


def _mfu_peak(f: PointFiles, causal: bool = False, peak_key: str = 'peak_bf16'):
  """Against the datasheet dense peak (`peak_key`: bf16's, or fp8's for an fp8 point) of the
  device the point ran on (None: none, a CPU, no such peak, or fp8's for a point that is not
  fp8); the attention counted over every pair (PaLM's count) or, `causal`, over half of them."""
  from configs.hardware import datasheet
  peak = datasheet(f.memory('device_kind') or '')
  config, tokens_per_sec, devices = f.config, _tokens_per_sec(f), _devices(f)
  if peak is None or config is None or tokens_per_sec is None or not devices:
    return None
  if peak[peak_key] is None or (peak_key == 'peak_fp8' and config.quant.mode != 'fp8'):
    return None
  from train.checks import model_config
  flops = model_config(config).flops_per_token(config.train.seq_len, not config.lora.rank,
                                               causal=causal)
  return flops * tokens_per_sec / devices / peak[peak_key]


def _measured_step_s(f: PointFiles):
  tokens_per_sec, config = _tokens_per_sec(f), f.config
  if not tokens_per_sec or config is None:
    return None
  return config.train.batch_size * config.train.seq_len / tokens_per_sec


def _on_target(f: PointFiles) -> bool:
  """Whether the point ran on the sweep's target GPU (its modelled and measured times compare)."""
  from configs.hardware import DEVICE_KINDS
  return DEVICE_KINDS.get(f.memory('device_kind') or '') == f.target


def _modelled_vs_measured(f: PointFiles):
  modelled, measured = (_modelled(f) or {}).get('step_s'), _measured_step_s(f)
  return modelled / measured if modelled and measured and _on_target(f) else None


def _calibrated_mfu(f: PointFiles):
  """The MFU the cost model would have to assume (plan/cost.py MFU_ASSUMED) for its step time to
  be the measured one: its compute at MFU_ASSUMED, scaled to the measured time less the parts it
  does not scale (optimizer, tensor and pipeline traffic). Only on the target GPU."""
  from plan.cost import MFU_ASSUMED
  seconds, measured = (_modelled(f) or {}).get('seconds'), _measured_step_s(f)
  if not seconds or not measured or not _on_target(f):
    return None
  fixed = seconds['total'] - max(seconds['compute'], seconds['data_parallel_comm'])
  if measured <= fixed:
    return None
  return MFU_ASSUMED * seconds['compute'] / (measured - fixed)


def _peak_vs_estimate(f: PointFiles):
  peak, estimate = f.memory('peak_device_bytes'), f.memory('estimate_gpu_bytes', 'total')
  return peak / estimate if peak and estimate else None


def _bench(key, scale=1.0):
  def read(f: PointFiles):
    bench = f.json('bench.json')
    value = None if bench is None else bench.get(key)
    return value * scale if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else value
  return read


def _bytes_gb(*keys):
  def read(f: PointFiles):
    value = f.memory(*keys)
    return None if value is None else value / GB
  return read


def _estimate_error(f: PointFiles):
  """The analytic estimate against the compiled total, in percent (+: the estimate is larger)."""
  compiled, estimate = f.memory('per_device_bytes', 'total'), f.memory('estimate_bytes', 'total')
  return None if not compiled or estimate is None else 100 * (estimate / compiled - 1)


def _collective_gb(f: PointFiles):
  collectives = f.memory('collectives_per_step')
  return None if collectives is None else sum(c['bytes'] for c in collectives.values()) / GB


def _fits(f: PointFiles):
  """Whether the compiled step fits one device of the sweep's target (no margin kept)."""
  from configs.hardware import GPUS
  total = f.memory('per_device_bytes', 'total')
  return None if total is None else ('yes' if total <= GPUS[f.target]['memory'] else 'no')


def _state_bytes_per_param(f: PointFiles):
  """Weights, gradients and optimizer state per parameter on one device (the analytic model)."""
  estimate, n = f.memory('estimate_bytes'), f.memory('num_params')
  if not estimate or not n:
    return None
  return (estimate['params'] + estimate['grads'] + estimate['optimizer']) / n


def _params_m(key):
  def read(f: PointFiles):
    value = f.memory(key)
    return None if value is None else value / 1e6
  return read


def _modelled(f: PointFiles) -> dict | None:
  """The cost model's step on `target` for the point's recipe and mesh."""
  config, devices = f.config, _devices(f)
  if config is None or not devices or f.memory('mesh') is None:
    return None
  from configs.hardware import GPUS
  from plan.cost import Recipe, step_seconds
  from plan.target import Target
  from precision.policy import get_policy
  from train.checks import model_config
  mesh, train, parallel = f.memory('mesh'), config.train, config.parallel
  recipe = Recipe(precision=config.precision, adam_bits=config.quant.adam_bits,
                  zero_stage=parallel.zero_stage, tensor=mesh['tensor'], remat=config.model.remat,
                  microbatches=train.microbatches, stages=mesh['stage'],
                  **({} if mesh['stage'] == 1 else dict(
                      pipeline_microbatches=parallel.pipeline_microbatches,
                      schedule=parallel.pipeline_schedule, repeats=parallel.pipeline_repeats)))
  cfg = model_config(config)
  base_trains = not config.lora.rank
  seconds = step_seconds(cfg, recipe, train.batch_size, train.seq_len,
                         Target(devices, f.target, **GPUS[f.target]), get_policy(config.precision),
                         base_trains)
  flops = cfg.flops_per_token(train.seq_len, base_trains) * train.batch_size * train.seq_len
  return {'step_s': seconds['total'], 'tflops': flops / seconds['total'] / devices / 1e12,
          'seconds': seconds}


def _plan(key):
  def read(f: PointFiles):
    plan = f.json('plan.json')
    return None if plan is None else plan.get(key)
  return read


def _sweep(key):
  def read(f: PointFiles):
    record = f.json('sweep.json')
    return None if record is None else record.get(key)
  return read


METRICS = {
    'final_loss': Metric('validation loss (nats/token)', lambda f: _final_eval(f, 'eval_loss'), 4),
    'final_loss_sem': Metric('± s.e. (nats/token)', lambda f: _final_eval(f, 'eval_loss_sem'), 4),
    'best_loss': Metric('best validation loss (nats/token)', _best_loss, 4),
    'bits_per_byte': Metric('validation bits/byte', lambda f: _final_eval(f, 'eval_bits_per_byte'), 4),
    'tokens_per_sec': Metric('tokens/s', _tokens_per_sec, 0),
    'mfu': Metric('MFU', _mfu, 3),
    'mfu_peak': Metric('MFU of the datasheet bf16 peak (PaLM count)', _mfu_peak, 3),
    'mfu_peak_causal': Metric('MFU of the datasheet bf16 peak (causal count)',
                              lambda f: _mfu_peak(f, causal=True), 3),
    'mfu_peak_fp8': Metric('MFU of the datasheet fp8 peak (PaLM count; fp8 points)',
                           lambda f: _mfu_peak(f, peak_key='peak_fp8'), 3),
    'step_ms': Metric('step (ms)', _bench('step_seconds', 1e3), 1),
    'attention': Metric('attention', _bench('attention')),
    'peak_vs_estimate': Metric('peak ÷ GPU estimate', _peak_vs_estimate, 3),
    'modelled_vs_measured': Metric('modelled ÷ measured step', _modelled_vs_measured, 3),
    'calibrated_mfu': Metric('MFU the cost model would need', _calibrated_mfu, 3),
    'compiled_gb': Metric('compiled per device (GB)', _bytes_gb('per_device_bytes', 'total'), 2),
    'estimate_gb': Metric('estimate per device (GB)', _bytes_gb('estimate_bytes', 'total'), 2),
    'estimate_error': Metric('estimate - compiled (%)', _estimate_error, 1),
    'estimate_gpu_gb': Metric('estimate on a GPU per device (GB)',
                              _bytes_gb('estimate_gpu_bytes', 'total'), 2),
    'peak_gb': Metric('peak device memory (GB)', _bytes_gb('peak_device_bytes'), 2),
    'fits': Metric('compiled fits the target device', _fits),
    'collective_gb': Metric('collectives per step per device (GB)', _collective_gb, 2),
    'state_bytes_per_param': Metric('model state (bytes/param)', _state_bytes_per_param, 2),
    'params_m': Metric('parameters (M)', _params_m('num_params'), 2),
    'trainable_m': Metric('trainable parameters (M)', _params_m('trainable_params'), 4),
    'modelled_step_s': Metric('modelled step on target (s)',
                              lambda f: (_modelled(f) or {}).get('step_s'), 3),
    'modelled_tflops': Metric('modelled TFLOP/s per GPU on target',
                              lambda f: (_modelled(f) or {}).get('tflops'), 1),
    'plan_recipe': Metric('planned recipe', _plan('recipe')),
    'plan_step_s': Metric('planned step (s, modelled)', _plan('step_seconds'), 3),
    'plan_compiled_gb': Metric('planned recipe compiled per device (GB)',
                               lambda f: None if _plan('compiled_bytes')(f) is None
                               else _plan('compiled_bytes')(f) / GB, 2),
    'wall_s': Metric('wall time (s)', _sweep('wall_s'), 0),
}
