"""What host offload fits where (issue 31): per-device and per-node host memory by the analytic
estimate for a GPU (memory/estimate.py, backend 'gpu': without XLA:CPU's fp32 copies), and the
planner's modelled step time (plan/cost.py), with and without the optimizer's state (and the
saved activations) in host memory. Estimates only; `main.py --dry_run` compiles each case (the
commands are in WORKSPACE.md, issue 31).

  python -m bench.studies.offload
  python -m bench.studies.offload --compiled      # and 100m on 8 simulated devices, compiled
"""
from absl import app, flags

_COMPILED = flags.DEFINE_bool('compiled', False, 'Also compile 100m on 8 simulated CPU devices '
                              'under ZeRO-1/2/3 with and without offload, beside the estimate.')

GB = 1e9
# Full fine-tuning: bf16 weights, fp32 master, 32-bit Adam; one sequence of 2048 tokens a step.
FULL_FT = {'precision': 'bf16_master', 'train.batch_size': 1, 'train.seq_len': 2048,
           'train.microbatches': 1, 'model.remat': 'full'}


def case(preset: str, gpus: int, zero_stage: int, offload: bool, **overrides):
  """(device bytes, host bytes per node, step seconds, params) of `preset` on `gpus` H100s."""
  from configs import default
  from memory.estimate import StepShape, estimate, offloaded
  from plan.cost import Recipe, step_seconds
  from plan.target import parse_target
  from precision.policy import get_policy
  from train import checks

  config = default.get_config(preset)
  settings = {**FULL_FT, **overrides}
  if offload:
    settings['model.remat'] = 'offload'
  for key, value in settings.items():
    default.override(config, key, value)
  cfg, policy = checks.model_config(config), get_policy(config.precision)
  train = config.train
  shape = StepShape(train.batch_size // gpus, train.seq_len, fsdp=gpus, zero_stage=zero_stage,
                    data_parallel=gpus, backend='gpu', offload_optimizer=offload)
  device = estimate(cfg, policy, shape)['total']
  host = offloaded(cfg, policy, shape)['total'] * min(gpus, 8)
  target = parse_target(f'{gpus}xH100-80GB')
  recipe = Recipe(config.precision, 32, zero_stage, 1, cfg.remat, 1, offload=offload)
  seconds = step_seconds(cfg, recipe, train.batch_size, train.seq_len, target, policy)['total']
  return device, host, seconds, cfg.num_params


def largest(memory_gb: float, width_preset: str, offload: bool) -> tuple[int, float]:
  """The most layers (and parameters) of `width_preset`'s width that full-fine-tune on one GPU of
  `memory_gb` (under 90 % of it, as the planner allows), with or without offload."""
  best = (0, 0.0)
  for layers in range(1, 200):
    device, host, _, params = case(width_preset, 1, 0, offload, **{'model.num_layers': layers})
    if device > 0.9 * memory_gb * GB:
      break
    best = (layers, params)
  return best


def compiled_table():
  """100m on 8 simulated devices, bf16_master, one sequence per device: compiled device and host
  bytes beside the CPU estimate, and the GPU estimate."""
  import jax
  from configs import default
  from train import run
  G = 2**30
  print('| 100m, 8 devices | offload | compiled device GiB | estimate GiB (error) | compiled host '
        'GiB | estimate host GiB | GPU estimate device GiB |')
  print('|---|---|---:|---:|---:|---:|---:|')
  for zero in (1, 2, 3):
    for offload, remat in ((False, 'full'), (True, 'full'), (True, 'offload')):
      config = default.get_config('100m')
      for key, value in {'precision': 'bf16_master', 'mesh.data': 1, 'mesh.fsdp': 8,
                         'parallel.zero_stage': zero, 'train.batch_size': 8,
                         'train.microbatches': 1, 'model.remat': remat,
                         'parallel.offload_optimizer': offload}.items():
        default.override(config, key, value)
      s = run.setup(config, jax.devices()[:8])
      report = run.memory_report(s, run.compile_train_step(s))
      device, estimate = report['per_device_bytes']['total'], report['estimate_bytes']['total']
      host = report.get('host_bytes', {}).get('total', 0)
      host_estimate = report.get('estimate_host_bytes', {}).get('total', 0)
      what = ('optimizer' if offload else 'none') + (' + activations' if remat == 'offload' else '')
      print(f'| ZeRO-{zero}, remat {remat} | {what} | {device / G:.4f} | {estimate / G:.4f} '
            f'({100 * (estimate / device - 1):+.1f} %) | {host / G:.4f} | {host_estimate / G:.4f} '
            f'| {report["estimate_gpu_bytes"]["total"] / G:.4f} |', flush=True)


def main(argv):
  del argv
  if _COMPILED.value:
    import jax
    jax.config.update('jax_num_cpu_devices', 8)
  print('| model, tokens a sequence | H100-80GBs | ZeRO | offload | device GB (estimate, GPU) | '
        'fits 72 GB | host GB per node | step s (model) | tokens/s (model) |')
  print('|---|---:|---:|---|---:|---|---:|---:|---:|')
  long = {'train.seq_len': 8192, 'model.max_seq_len': 8192}
  # One sequence per GPU a step; the same model without offload on as many GPUs as it needs.
  cases = [('7b', 2048, 1, 0, True, {}), ('7b', 2048, 1, 0, False, {}),
           ('7b', 2048, 2, 3, False, {}), ('7b', 2048, 4, 3, False, {}),
           ('70b', 8192, 8, 3, True, long), ('70b', 8192, 8, 3, False, long),
           ('70b', 8192, 16, 3, False, long), ('70b', 8192, 32, 3, False, long)]
  for preset, tokens, gpus, stage, offload, overrides in cases:
    device, host, seconds, _ = case(preset, gpus, stage, offload,
                                    **{**overrides, 'train.batch_size': gpus})
    print(f'| {preset}, {tokens} | {gpus} | {stage} | {"yes" if offload else "no"} '
          f'| {device / GB:.1f} | {"yes" if device <= 72 * GB else "no"} | {host / GB:.0f} '
          f'| {seconds:.2f} | {gpus * tokens / seconds:,.0f} |')
  print('\n| GPU memory | width | offload | most layers | parameters (B) |')
  print('|---:|---|---|---:|---:|')
  for memory in (24, 40, 80):
    for width in ('7b', '20b'):
      for offload in (False, True):
        layers, params = largest(memory, width, offload)
        print(f'| {memory} GB | {width} (d_model {"4096" if width == "7b" else "6144"}) | '
              f'{"yes" if offload else "no"} | {layers} | {params / 1e9:.2f} |')
  if _COMPILED.value:
    print()
    compiled_table()


if __name__ == '__main__':
  app.run(main)
