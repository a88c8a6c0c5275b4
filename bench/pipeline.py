"""The pipeline's bubble against its microbatch count, GPipe against circular, beside the compiled
per-device memory and the collective-permute traffic of each step. Nothing is allocated.

  python -m bench.pipeline [--stages=4,8] [--preset=small] [--config.<key>=<value> ...]

For P stages and M = P, 2P, 4P, 8P microbatches: the bubble measured on the schedule's table (the
one the compiled loop reads) beside GPipe's formula (P - 1) / (M R + P - 1), the compiled bytes per
device beside the analytic estimate, and the collective-permutes and all-to-alls per step. The
mesh is P stages x (devices / P) fsdp. Step time on simulated CPU devices says nothing about the
bubble (they share the same cores), so none is reported.
"""
import json
import sys

from absl import app, flags, logging

_STAGES = flags.DEFINE_list('stages', ['4', '8'], 'Pipeline stage counts.')
_PRESET = flags.DEFINE_string('preset', 'small', 'Model preset.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices.')
_LAYERS = flags.DEFINE_integer('num_layers', 16, 'Model depth (divisible by stages x 2).')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Global batch in sequences.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Chunks per stage of the circular schedule.')
_OUT = flags.DEFINE_string('out', 'bench/results/pipeline.json', 'Where the rows are written.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from configs import default
  from configs.layouts import layout_config
  MiB = 2.0 ** 20
  from train import checks, run

  rows = []
  print('| P | M | schedule | bubble (table) | (P-1)/(MR+P-1) | compiled MiB/device | estimate '
        '| collective-permute ops, MiB | all-to-all MiB |')
  print('|---:|---:|---|---:|---:|---:|---:|---:|---:|')
  for stages in map(int, _STAGES.value):
    for m in (stages, 2 * stages, 4 * stages, 8 * stages):
      for schedule, repeats in (('gpipe', 1), ('circular', _REPEATS.value)):
        config = layout_config('pipeline', _PRESET.value)
        for key, value in {'mesh.stage': stages, 'mesh.fsdp': -1, 'model.num_layers': _LAYERS.value,
                           'train.batch_size': _BATCH.value, 'parallel.pipeline_microbatches': m,
                           'parallel.pipeline_schedule': schedule,
                           'parallel.pipeline_repeats': repeats}.items():
          default.override(config, key, value)
        try:
          s = run.setup(config)
        except checks.ConfigError as e:
          sys.exit(f'error: P={stages} M={m} {schedule}: {e}')
        memory = run.memory_report(s, run.compile_train_step(s))
        pipe, collectives = memory['pipeline'], memory['collectives_per_step']
        row = {'stages': stages, 'microbatches': m, 'schedule': schedule, 'repeats': repeats,
               'bubble_fraction': pipe['bubble_fraction'], 'bubble_formula': pipe['bubble_formula'],
               'compiled_bytes': memory['per_device_bytes']['total'],
               'estimate_bytes': memory['estimate_bytes']['total'],
               'collective_permute': collectives['collective-permute'],
               'all_to_all': collectives['all-to-all'], 'mesh': memory['mesh']}
        rows.append(row)
        permute = row['collective_permute']
        print(f'| {stages} | {m} | {schedule}{f" (R={repeats})" if repeats > 1 else ""} '
              f'| {row["bubble_fraction"]:.3f} | {row["bubble_formula"]:.3f} '
              f'| {row["compiled_bytes"] / MiB:.1f} | {row["estimate_bytes"] / MiB:.1f} '
              f'| {permute["count"]}, {permute["bytes"] / MiB:.1f} '
              f'| {row["all_to_all"]["bytes"] / MiB:.1f} |')
        sys.stdout.flush()
  with open(_OUT.value, 'w', encoding='utf-8') as f:
    json.dump({'jax': jax.__version__, 'rows': rows}, f, indent=1)
    f.write('\n')


if __name__ == '__main__':
  app.run(main)
