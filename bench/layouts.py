"""Per-device memory and collective traffic of every parallel layout, from the compiled train step,
beside the ZeRO paper's model-state formulas for mixed-precision Adam. Nothing is allocated.

  python -m bench.layouts --preset=100m --devices=8 [--precision=bf16_master] [--partitioned]

Ψ = parameter count, N = data-parallel degree (the fsdp axis for ZeRO). The paper's formulas count
bytes of model state: 16-bit parameters (2Ψ), 16-bit gradients (2Ψ) and the fp32 master copy plus
two Adam moments (12Ψ). `bf16_master` keeps exactly that split; `bf16_mixed` keeps the fp32 master
*as* the parameters and fp32 gradients: 4Ψ + 4Ψ + 8Ψ, the same 16Ψ split differently.

Model state (compiled) = the step's arguments (parameters and optimizer state, as XLA sizes them),
less the batch, plus the gradients at the sharding the step keeps them in (they live in XLA's
temp, beside the activations, where the compiler does not itemise them).
`--partitioned` adds the collectives of the program as the SPMD partitioner emits it (before
XLA:CPU widens bf16 matmul operands, and the gathers feeding them, to fp32; parallel/collectives.py):
one more compile per layout.
"""
import math
import sys

from absl import app, flags, logging

from train.setup import Setup

_PRESET = flags.DEFINE_string('preset', '100m', 'Model preset.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices.')
_PRECISION = flags.DEFINE_string('precision', 'bf16_mixed', 'Precision policy.')
_BATCH = flags.DEFINE_integer('batch_size', 8, 'Global batch in sequences.')
_SEQ = flags.DEFINE_integer('seq_len', 512, 'Sequence length.')
_REMAT = flags.DEFINE_string('remat', 'full', 'Remat policy.')
_PARTITIONED = flags.DEFINE_bool('partitioned', False, 'Also count the collectives as partitioned.')


def zero_formula(layout: str, psi: int, n: int) -> float | None:
  return {'ddp': 16 * psi, 'zero1': 4 * psi + 12 * psi / n, 'zero2': 2 * psi + 14 * psi / n,
          'fsdp': 16 * psi / n}.get(layout)


def model_state_bytes(s: Setup, compiled_arguments: int) -> int:
  """Compiled arguments less the batch, plus the gradients at their sharding."""
  from parallel.sharding import device_bytes
  train = s.config.train
  batch = 2 * train.batch_size * train.seq_len * 4 // math.prod(
      s.mesh.shape[a] for a in ('data', 'fsdp'))
  return compiled_arguments - batch + device_bytes(s.layout.abstract['params'],
                                                   s.layout.grad_shardings)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from configs.layouts import LAYOUTS, layout_config
  from memory.compiled import GiB, compiled_memory
  from parallel.collectives import partitioned_collectives
  from train import checks, run

  partitioned = ' | all-gather (partitioned) | all-reduce (partitioned)' if _PARTITIONED.value else ''
  print('| layout | mesh (stage, data, fsdp, tensor) | ZeRO formula | model state (compiled) '
        '| compiled arguments | temp | total | estimate | all-gather | all-reduce | reduce-scatter '
        f'| other collectives{partitioned} |')
  print('|---|---|' + '---:|' * (12 if _PARTITIONED.value else 10))
  for layout in LAYOUTS:
    if layout == 'pipeline':
      continue
    config = layout_config(layout, _PRESET.value)
    config.precision = _PRECISION.value
    config.model.remat = _REMAT.value
    config.train.batch_size, config.train.seq_len = _BATCH.value, _SEQ.value
    config.train.microbatches = 1
    try:
      s = run.setup(config)
    except checks.ConfigError as e:
      sys.exit(f'error: {layout}: {e}')
    lowered = run.lower_train_step(s)
    with s.context():
      compiled = lowered.compile()
    memory = run.memory_report(s, compiled)
    sizes, collectives = memory['per_device_bytes'], memory['collectives_per_step']
    psi, shape = memory['num_params'], memory['mesh']
    formula = zero_formula(layout, psi, shape['fsdp'])
    state = model_state_bytes(s, compiled_memory(compiled)['arguments'])
    other = sum(collectives[k]['bytes'] for k in ('all-to-all', 'collective-permute'))
    gib = lambda b: f'{b / GiB:.3f}'
    row = (f'| {layout} | {shape["stage"]}, {shape["data"]}, {shape["fsdp"]}, {shape["tensor"]} | '
           f'{gib(formula) if formula else "-"} | {gib(state)} | {gib(sizes["arguments"])} '
           f'| {gib(sizes["temp"])} | {gib(sizes["total"])} | {gib(memory["estimate_bytes"]["total"])} '
           f'| {gib(collectives["all-gather"]["bytes"])} | {gib(collectives["all-reduce"]["bytes"])} '
           f'| {gib(collectives["reduce-scatter"]["bytes"])} | {gib(other)}')
    if _PARTITIONED.value:
      with s.context():
        asked = partitioned_collectives(lowered, s.mesh.size)
      row += f' | {gib(asked["all-gather"]["bytes"])} | {gib(asked["all-reduce"]["bytes"])}'
    print(row + ' |')
    sys.stdout.flush()
  print(f'\nΨ = {psi:,} parameters; precision {_PRECISION.value}; GiB per device; collectives in '
        f'GiB per step per device.')


if __name__ == '__main__':
  app.run(main)
