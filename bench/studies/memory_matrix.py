"""The analytic memory model (memory/estimate.py) against XLA's compiled per-device total, over a
matrix of layouts, precisions, remat policies, Adam widths and microbatch counts. Every config is
compiled dry-run style (`run.setup` + `run.compile_train_step` on the abstract state): nothing is
allocated, so the large presets size on a laptop.

  python -m bench.studies.memory_matrix          # `small`-preset shapes on 8 simulated CPU devices
  python -m bench.studies.memory_matrix --large  # 1b and 7b on 8 devices, 70b on 64
  python -m bench.studies.memory_matrix --long   # 7b at 4k-32k tokens per attention, 1b's chunked
                                                 # loss

The last column names the part of the compiled total the estimate misses most: `arguments`
(parameters and optimizer state), `outputs` (returned state that cannot reuse a donated buffer)
or `temp` (everything else: gradients, activations, temporaries), estimate minus compiled.
"""
import sys
import time

from absl import app, flags, logging

_LARGE = flags.DEFINE_bool('large', False, 'The 1b, 7b (8 devices) and 70b (64 devices) presets.')
_LONG = flags.DEFINE_bool('long', False, 'Long context: 7b at 4k-32k tokens with each attention '
                          'implementation and the chunked loss; 1b with and without it.')

# (layout, preset, devices, overrides): configs/layouts.py's layouts on top of a preset.
SMALL = (
    ('ddp', 'small', 8, {'precision': 'fp32'}),
    ('ddp', 'small', 8, {'precision': 'bf16_mixed'}),
    ('ddp', 'small', 8, {'precision': 'bf16'}),
    ('ddp', 'small', 8, {'precision': 'fp32', 'quant.adam_bits': 8}),
    ('zero1', 'small', 8, {'precision': 'bf16_mixed', 'train.microbatches': 2}),
    ('zero2', 'small', 8, {'precision': 'fp32'}),
    ('zero2', 'small', 8, {'precision': 'bf16_mixed', 'model.remat': 'full'}),
    ('fsdp', 'small', 8, {'precision': 'fp32'}),
    ('fsdp', 'small', 8, {'precision': 'bf16_mixed', 'model.remat': 'dots'}),
    ('fsdp', 'small', 8, {'precision': 'bf16', 'quant.adam_bits': 8}),
    ('fsdp', 'small', 8, {'precision': 'bf16_mixed', 'model.remat': 'full', 'train.microbatches': 4,
                          'train.batch_size': 32, 'model.vocab_size': 4096}),
    ('tp', 'small', 8, {'precision': 'bf16_mixed'}),
    ('tp', 'small', 8, {'precision': 'fp32', 'model.remat': 'qkv'}),
    ('fsdp_tp', 'small', 8, {'precision': 'bf16_mixed'}),
    ('fsdp_tp', 'small', 8, {'precision': 'fp32', 'model.remat': 'full', 'train.microbatches': 2}),
    ('fsdp', 'small', 8, {'precision': 'bf16_mixed', 'model.tie_embeddings': False,
                          'model.vocab_size': 4096}),
)

# The presets' own training shapes (bf16_mixed, full remat, microbatches) unless overridden.
LARGE = (
    ('ddp', '1b', 8, {}),
    ('zero1', '1b', 8, {}),
    ('zero2', '1b', 8, {}),
    ('fsdp', '1b', 8, {}),
    ('tp', '1b', 8, {}),
    ('fsdp_tp', '1b', 8, {}),
    ('fsdp', '1b', 8, {'precision': 'fp32'}),
    ('fsdp', '1b', 8, {'precision': 'bf16'}),
    ('fsdp', '1b', 8, {'quant.adam_bits': 8}),
    ('fsdp', '1b', 8, {'model.remat': 'dots'}),
    ('fsdp', '1b', 8, {'train.microbatches': 1, 'train.batch_size': 8}),
    ('fsdp', '7b', 8, {}),
    ('zero2', '7b', 8, {}),
    ('tp', '7b', 8, {}),
    ('fsdp_tp', '7b', 8, {}),
    ('fsdp', '7b', 8, {'precision': 'bf16'}),
    ('fsdp', '7b', 8, {'quant.adam_bits': 8}),
    ('fsdp', '7b', 8, {'train.microbatches': 1, 'train.batch_size': 8}),
    ('fsdp', '7b', 8, {'model.remat': 'dots', 'train.seq_len': 2048}),
    ('fsdp', '70b', 64, {}),
    ('fsdp_tp', '70b', 64, {}),
    ('fsdp', '70b', 64, {'quant.adam_bits': 8}),
)

# Long context (issue 12's table): ZeRO-3 over 8 devices, full remat, one sequence per device per
# microbatch (batch 32 in 4 microbatches), at each length, per attention and loss chunking.
LONG = tuple(
    ('fsdp', '7b', 8, {'train.seq_len': seq, 'model.max_seq_len': 32768, 'model.attention': attention,
                       **({'model.loss_chunk': chunk} if chunk else {})})
    for seq in (4096, 8192, 16384, 32768)
    for attention, chunk in (('xla', 0), ('flash', 0), ('flash', 1024))
) + (
    ('fsdp', '1b', 8, {'model.loss_chunk': 0}),
    ('fsdp', '1b', 8, {'model.loss_chunk': 1024}),
    ('fsdp', '1b', 8, {'train.seq_len': 8192, 'train.batch_size': 16, 'train.microbatches': 2}),
    ('fsdp', '1b', 8, {'train.seq_len': 8192, 'train.batch_size': 16, 'train.microbatches': 2,
                       'model.loss_chunk': 1024}),
    ('tp', '1b', 8, {'model.loss_chunk': 0}),
    ('tp', '1b', 8, {'model.loss_chunk': 1024}),
)


def config_for(layout: str, preset: str, overrides: dict):
  from configs.layouts import layout_config
  config = layout_config(layout, preset)
  config.update_from_flattened_dict(overrides)
  return config


def describe(layout: str, preset: str, overrides: dict) -> str:
  short = ', '.join(f'{key.split(".")[-1]}={value}' for key, value in overrides.items())
  return f'{layout}:{preset}' + (f' ({short})' if short else '')


def compiled_parts(memory: dict) -> dict:
  """(estimate, compiled) bytes of each part: arguments, un-donated outputs, temp."""
  compiled, est = memory['per_device_bytes'], memory['estimate_bytes']
  state = ('params', 'optimizer')
  return {
      'arguments': (est['params'] + est['optimizer'], compiled['arguments']),
      'outputs': (est.get('outputs', 0), compiled['outputs'] - compiled['aliased']),
      'temp': (sum(v for k, v in est.items() if k not in state + ('outputs', 'total')),
               compiled['temp']),
  }


def compare(layout: str, preset: str, devices: int, overrides: dict) -> dict:
  """Compile one config on the first `devices` devices; the estimate beside the compiled figure."""
  import jax
  from train import run
  s = run.setup(config_for(layout, preset, overrides), devices=jax.devices()[:devices])
  start = time.perf_counter()
  memory = run.memory_report(s, run.compile_train_step(s))
  compiled, est = memory['per_device_bytes']['total'], memory['estimate_bytes']['total']
  gaps = {name: e - c for name, (e, c) in compiled_parts(memory).items()}
  worst = max(gaps, key=lambda name: abs(gaps[name]))
  return {'config': describe(layout, preset, overrides), 'mesh': memory['mesh'],
          'compiled': compiled, 'estimate': est, 'error': est / compiled - 1,
          'worst_part': worst, 'worst_gap': gaps[worst], 'seconds': time.perf_counter() - start,
          'memory': memory}


def table_header(unit: str) -> str:
  return (f'| config | devices (data, fsdp, tensor) | compiled total ({unit}) | estimate ({unit}) '
          f'| error | largest part difference ({unit}) |\n|---|---|---:|---:|---:|---|')


def table_row(row: dict, unit: str) -> str:
  scale = 2.0**30 if unit == 'GiB' else 2.0**20
  digits = 2 if unit == 'GiB' else 1
  mesh = row['mesh']
  devices = mesh.get('stage', 1) * mesh['data'] * mesh['fsdp'] * mesh['tensor']
  stage = f'{mesh["stage"]} stages x ' if mesh.get('stage', 1) > 1 else ''
  return (f'| {row["config"]} | {devices} ({stage}{mesh["data"]}, {mesh["fsdp"]}, {mesh["tensor"]}) '
          f'| {row["compiled"] / scale:,.{digits}f} | {row["estimate"] / scale:,.{digits}f} '
          f'| {100 * row["error"]:+.1f} % '
          f'| {row["worst_part"]} {row["worst_gap"] / scale:+,.{digits}f} |')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  matrix = LONG if _LONG.value else LARGE if _LARGE.value else SMALL
  import jax
  jax.config.update('jax_num_cpu_devices', max(devices for _, _, devices, _ in matrix))
  unit = 'GiB' if _LARGE.value or _LONG.value else 'MiB'
  print(table_header(unit))
  start, errors = time.perf_counter(), []
  for layout, preset, devices, overrides in matrix:
    row = compare(layout, preset, devices, overrides)
    errors.append(abs(row['error']))
    print(table_row(row, unit))
    sys.stdout.flush()
  print(f'\n{len(errors)} configs; |error| at most {100 * max(errors):.1f} %, mean '
        f'{100 * sum(errors) / len(errors):.1f} %; {time.perf_counter() - start:.0f} s in all. '
        f'Compiled total = arguments + outputs - donated + temp, per device.')


if __name__ == '__main__':
  app.run(main)
