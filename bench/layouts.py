"""Per-device memory and collective traffic of every parallel layout, from the compiled train step,
beside the ZeRO paper's model-state formulas for mixed-precision Adam. Nothing is allocated.

  python -m bench.layouts --preset=100m --devices=8 [--config.<key>=<value> ...]

Ψ = parameter count, N = data-parallel degree (the fsdp axis for ZeRO). The paper's formulas count
bytes of model state: fp16 parameters (2Ψ), fp16 gradients (2Ψ) and the fp32 master copy plus two
Adam moments (12Ψ). Our bf16_mixed policy keeps the fp32 master *as* the parameters and fp32
gradients, so our own model state is 4Ψ + 4Ψ + 8Ψ: the same 16Ψ in total, split differently.
"""
import sys

from absl import app, flags, logging

_PRESET = flags.DEFINE_string('preset', '100m', 'Model preset.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices.')
_PRECISION = flags.DEFINE_string('precision', 'bf16_mixed', 'Precision policy.')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'Global batch in sequences.')
_SEQ = flags.DEFINE_integer('seq_len', 512, 'Sequence length.')
_REMAT = flags.DEFINE_string('remat', 'full', 'Remat policy.')


def zero_formula(layout: str, psi: int, n: int) -> float | None:
  return {'ddp': 16 * psi, 'zero1': 4 * psi + 12 * psi / n, 'zero2': 2 * psi + 14 * psi / n,
          'fsdp': 16 * psi / n}.get(layout)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from configs.layouts import LAYOUTS, layout_config
  from memory.compiled import GiB
  from train import checks, run

  print('| layout | mesh (stage, data, fsdp, tensor) | ZeRO formula | compiled arguments | temp | total '
        '| estimate | all-gather | all-reduce | reduce-scatter | other collectives |')
  print('|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  for layout in LAYOUTS:
    config = layout_config(layout, _PRESET.value)
    config.precision = _PRECISION.value
    config.model.remat = _REMAT.value
    config.train.batch_size, config.train.seq_len = _BATCH.value, _SEQ.value
    config.train.microbatches = 1
    try:
      s = run.setup(config)
    except checks.ConfigError as e:
      sys.exit(f'error: {layout}: {e}')
    memory = run.memory_report(s, run.compile_train_step(s))
    compiled, collectives = memory['per_device_bytes'], memory['collectives_per_step']
    psi, shape = memory['num_params'], memory['mesh']
    formula = zero_formula(layout, psi, shape['fsdp'])
    other = sum(collectives[k]['bytes'] for k in ('all-to-all', 'collective-permute'))
    gib = lambda b: f'{b / GiB:.3f}'
    print(f'| {layout} | {shape["stage"]}, {shape["data"]}, {shape["fsdp"]}, {shape["tensor"]} | '
          f'{gib(formula) if formula else "-"} | {gib(compiled["arguments"])} | {gib(compiled["temp"])} '
          f'| {gib(compiled["total"])} | {gib(memory["estimate_bytes"]["total"])} '
          f'| {gib(collectives["all-gather"]["bytes"])} | {gib(collectives["all-reduce"]["bytes"])} '
          f'| {gib(collectives["reduce-scatter"]["bytes"])} | {gib(other)} |')
    sys.stdout.flush()
  print(f'\nΨ = {psi:,} parameters; GiB per device; collectives in GiB per step per device.')


if __name__ == '__main__':
  app.run(main)
