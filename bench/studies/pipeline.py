"""The pipeline schedules against their microbatch count: bubble, compiled per-device memory (total
and temp) beside the analytic estimate, and each step's collectives. Nothing is allocated.

  python -m bench.studies.pipeline [--stages=4,8] [--preset=small]
  python -m bench.studies.pipeline --preset=7b --num_layers=32 --batch_size=64   # WORKSPACE's 7B table
  python -m bench.studies.pipeline --num_layers=15 --stage_layers=3,4,4,4   # uneven stages
  python -m bench.studies.pipeline --compose [--schedules=1f1b]   # every precision / quant mode /
                                                  # LoRA through a pipeline (the first schedule)

For P stages and M = P, 2P, 4P, 8P microbatches (those that divide each device's rows), and each
schedule (gpipe, circular, 1f1b, interleaved_1f1b): the bubble measured on the schedule's table
(the one the compiled loop reads) beside the formula (P - 1) / (M R + P - 1), the compiled bytes
per device beside the analytic estimate, and the collective-permutes, all-to-alls and all-gathers
per step. The mesh is P stages x (devices / P) fsdp. Step time on simulated CPU devices says
nothing about the bubble (they share the same cores), so none is reported.
"""
import json
import sys

from absl import app, flags, logging

_STAGES = flags.DEFINE_list('stages', ['4', '8'], 'Pipeline stage counts.')
_PRESET = flags.DEFINE_string('preset', 'small', 'Model preset.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices.')
_LAYERS = flags.DEFINE_integer('num_layers', 16, 'Model depth.')
_STAGE_LAYERS = flags.DEFINE_string('stage_layers', '', 'parallel.pipeline_stage_layers: layers per '
                                    "chunk ('' : the default split).")
_SEQ_LEN = flags.DEFINE_integer('seq_len', 0, 'Tokens per sequence (0: the preset\'s).')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Global batch in sequences.')
_ACCUMULATION = flags.DEFINE_integer('microbatches', 1, 'Gradient-accumulation microbatches '
                                     '(train.microbatches), each split by the pipeline.')
_REPEATS = flags.DEFINE_integer('repeats', 2, 'Chunks per stage of the circular and '
                                'interleaved_1f1b schedules.')
_SCHEDULES = flags.DEFINE_list('schedules', ['gpipe', 'circular', '1f1b', 'interleaved_1f1b'],
                               'Schedules to compile.')
_GATHER_ONCE = flags.DEFINE_bool('gather_once', False, 'gpipe and circular with '
                                  'parallel.pipeline_gather_once (ZeRO-3 weights gathered once per '
                                  'step); the 1f1b schedules always gather once.')
_OUT = flags.DEFINE_string('out', 'bench/results/pipeline.json', 'Where the rows are written.')
_COMPOSE = flags.DEFINE_bool('compose', False, 'Instead: two steps of each precision, quant mode '
                             'and LoRA variant through the pipeline layout and on one device.')

def compose() -> None:
  import jax
  from bench.studies.compose import table
  from configs import default
  from configs.layouts import layout_config
  schedule = _SCHEDULES.value[0]
  repeats = 2 if schedule in ('circular', 'interleaved_1f1b') else 1

  def config_for(overrides, one_device):
    config = layout_config('pipeline', 'tiny')
    one = {'mesh': dict(stage=1, data=1, fsdp=1, tensor=1), 'parallel.zero_stage': 0}
    for key, value in {'model.num_layers': 8, 'parallel.pipeline_schedule': schedule,
                       'parallel.pipeline_repeats': repeats, **overrides,
                       **(one if one_device else {})}.items():
      default.override(config, key, value)
    return config, jax.devices()[:1] if one_device else None

  table('pipeline', config_for)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from configs import default
  from configs.layouts import layout_config
  MiB = 2.0 ** 20
  from train import checks, run

  if _COMPOSE.value:
    return compose()
  rows = []
  print('| P | M | schedule | bubble (table) | (P-1)/(MR+P-1) | compiled MiB/device | temp MiB '
        '| estimate MiB (error) | collective-permute ops, MiB | all-to-all MiB | all-gather MiB |')
  print('|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|')
  for stages in map(int, _STAGES.value):
    for m in (stages, 2 * stages, 4 * stages, 8 * stages):
      for schedule in _SCHEDULES.value:
        repeats = _REPEATS.value if schedule in ('circular', 'interleaved_1f1b') else 1
        config = layout_config('pipeline', _PRESET.value)
        for key, value in {'mesh.stage': stages, 'mesh.fsdp': -1, 'model.num_layers': _LAYERS.value,
                           'train.batch_size': _BATCH.value, 'parallel.pipeline_microbatches': m,
                           'train.microbatches': _ACCUMULATION.value,
                           'parallel.pipeline_schedule': schedule,
                           'parallel.pipeline_repeats': repeats,
                           'parallel.pipeline_stage_layers': _STAGE_LAYERS.value,
                           **({'train.seq_len': _SEQ_LEN.value} if _SEQ_LEN.value else {}),
                           'parallel.pipeline_gather_once': _GATHER_ONCE.value and schedule in (
                               'gpipe', 'circular')}.items():
          default.override(config, key, value)
        counts = _STAGE_LAYERS.value.split(',') if _STAGE_LAYERS.value else ()
        if counts and len(counts) != stages * repeats:   # a split names its own chunk count
          continue
        try:
          s = run.setup(config)
        except checks.ConfigError as e:
          if 'does not divide' in str(e):   # more microbatches than a device has rows
            continue
          sys.exit(f'error: P={stages} M={m} {schedule}: {e}')
        memory = run.memory_report(s, run.compile_train_step(s))
        pipe, collectives = memory['pipeline'], memory['collectives_per_step']
        row = {'stages': stages, 'microbatches': m, 'schedule': schedule, 'repeats': repeats,
               'chunk_layers': pipe['chunk_layers'],
               'gather_once': config.parallel.pipeline_gather_once,
               'bubble_fraction': pipe['bubble_fraction'], 'bubble_formula': pipe['bubble_formula'],
               'compiled_bytes': memory['per_device_bytes']['total'],
               'temp_bytes': memory['per_device_bytes']['temp'],
               'estimate_bytes': memory['estimate_bytes']['total'],
               'estimate_parts': memory['estimate_bytes'],
               'collective_permute': collectives['collective-permute'],
               'all_to_all': collectives['all-to-all'], 'all_gather': collectives['all-gather'],
               'reduce_scatter': collectives['reduce-scatter'],
               'all_reduce': collectives['all-reduce'],
               'mesh': memory['mesh']}
        rows.append(row)
        permute = row['collective_permute']
        error = row['estimate_bytes'] / row['compiled_bytes'] - 1
        print(f'| {stages} | {m} | {schedule}{f" (R={repeats})" if repeats > 1 else ""} '
              f'| {row["bubble_fraction"]:.3f} | {row["bubble_formula"]:.3f} '
              f'| {row["compiled_bytes"] / MiB:.1f} | {row["temp_bytes"] / MiB:.1f} '
              f'| {row["estimate_bytes"] / MiB:.1f} ({error:+.1%}) '
              f'| {permute["count"]}, {permute["bytes"] / MiB:.1f} '
              f'| {row["all_to_all"]["bytes"] / MiB:.1f} | {row["all_gather"]["bytes"] / MiB:.1f} |')
        sys.stdout.flush()
  with open(_OUT.value, 'w', encoding='utf-8') as f:
    json.dump({'jax': jax.__version__, 'rows': rows}, f, indent=1)
    f.write('\n')


if __name__ == '__main__':
  app.run(main)
