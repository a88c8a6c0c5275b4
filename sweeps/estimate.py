"""The memory estimate itself measured: the analytic per-device total (memory/estimate.py) against
the compiled one, with the error in percent, over every layout at every scale and the features
that change what a step holds, for two compilers: XLA:CPU (simulated CPU devices) and XLA:GPU
(compile-only H100s, `--dry_run --target`: the CUDA plugin, requirements-gpu-compile.txt). Each
point's estimate models its own compiler.

  python -m sweep --sweep=sweeps/estimate.py --workdir=runs/sweep-estimate        # both
  python -m sweep --sweep=sweeps/estimate.py:cpu --workdir=runs/sweep-estimate    # XLA:CPU only
  python -m sweep --sweep=sweeps/estimate.py:gpu --workdir=runs/sweep-estimate    # XLA:GPU only

Dry runs only (nothing allocated; the compiled figure is the installed jax's, which results.md
names). Points, bf16 compute with fp32 master weights
and Adam (bf16_mixed), full remat, one sequence per device, one microbatch unless named:
- the FSDP-against-DDP grid: the 100m, 1b, 7b and 70b presets x 8, 64 and 512 devices x DDP,
  ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-3 with 4-way tensor parallelism (sweeps/fsdp_vs_ddp.py's);
- GPT-2 shapes (LayerNorm, GELU MLP, biases, learned positions) at 100m and 1b on 8 devices;
- precisions and 8-bit Adam at 1b (ZeRO-3, 8 devices), and the presets' own microbatches;
- pipelines at 7b (4 stages x 2-way FSDP): every schedule (GPipe, circular, 1F1B, interleaved
  1F1B, ZB-H1; the last three added after `bench/results/sweeps/estimate/` was recorded), and
  ZB-H1 with the layers split 7, 9, 9, 7 (taken stage to stage);
- LoRA and QLoRA at 7b and 20b (8 devices, and QLoRA 20b on one);
- long context: 7b at 16k and 32k tokens (ZeRO-3, 8 devices);
- the default run (the small preset, fp32, no remat) on one device and under ZeRO-3 on 8;
- the recipes the planner chose for 7b on 8 GPUs and 70b on 64 when it verified with XLA:CPU
  (issue 30; its XLA:GPU plans since are in bench/results/plans/).
A point's `model` names its case (`7b-32k`, `1b-fp32`), so no two cases share a line.
"""
from sweep.grid import Point, axis, choices, product, zipped
from sweeps.fsdp_vs_ddp import DEVICES, LAYOUTS, MODELS

EIGHT = {'host_devices': 8, 'train.batch_size': 8}
GPT2 = {'model.norm': 'layer', 'model.mlp': 'gelu', 'model.positions': 'learned',
        'model.bias': True, 'model.rope_scaling': 'none'}


def case(model: str, layouts: dict, **overrides) -> list:
  """One named case on 8 devices, one point per layout."""
  return product(choices('model', {model: {**EIGHT, **overrides}}), choices('devices', {8: {}}),
                 choices('layout', layouts))


COMPILERS = {'cpu': 'XLA:CPU', 'gpu': 'XLA:GPU'}
GPU = 'H100-80GB'


def compiled_by(compiler: str, points: list) -> list:
  """The points compiled by `compiler` (a label): on the GPU, for as many H100s as the point has
  simulated devices."""
  out = []
  for p in points:
    overrides = dict(p.overrides)
    if compiler == 'gpu':
      overrides['target'] = f'{overrides.get("host_devices", 1)}x{GPU}'
    out.append(Point({**p.labels, 'compiler': COMPILERS[compiler]}, overrides))
  return out


def get_sweep(arg: str | None = None):
  if arg not in (None, *COMPILERS):
    raise ValueError(f'sweeps/estimate.py:{arg}: the argument is one of {", ".join(COMPILERS)} '
                     f'(or none: both)')
  devices = zipped(axis('host_devices', DEVICES, label='devices'),
                   axis('train.batch_size', DEVICES, label=''))   # one sequence per device
  grid = product(choices('model', MODELS), devices, choices('layout', LAYOUTS))
  cases = [
      *case('gpt2-100m', {k: LAYOUTS[k] for k in ('ddp', 'zero2', 'zero3', 'zero3_tp4')},
            config='configs/default.py:100m', **GPT2),
      *case('gpt2-1b', {k: LAYOUTS[k] for k in ('zero2', 'zero3')}, config='configs/default.py:1b',
            **GPT2),
      *case('1b-fp32', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:1b',
            precision='fp32'),
      *case('1b-bf16_master', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:1b',
            precision='bf16_master'),
      *case('1b-bf16', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:1b',
            precision='bf16'),
      *case('1b-adam8', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:1b',
            **{'quant.adam_bits': 8}),
      *case('1b-fp8', {'zero3': LAYOUTS['zero3']}, config='configs/fp8.py:1b'),
      *case('1b-int8', {'zero3': LAYOUTS['zero3']}, config='configs/int8.py:1b'),
      *case('1b-4microbatches', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:1b',
            **{'train.batch_size': 32, 'train.microbatches': 4}),
      *case('7b-gpipe', {'pipeline4': {'mesh.stage': 4, 'mesh.fsdp': 2, 'mesh.data': 1,
                                       'parallel.zero_stage': 3,
                                       'parallel.pipeline_microbatches': 4}},
            config='configs/pipeline.py:7b'),
      *case('7b-circular', {'pipeline4': {'mesh.stage': 4, 'mesh.fsdp': 2, 'mesh.data': 1,
                                          'parallel.zero_stage': 3,
                                          'parallel.pipeline_microbatches': 4,
                                          'parallel.pipeline_schedule': 'circular',
                                          'parallel.pipeline_repeats': 2}},
            config='configs/pipeline.py:7b'),
      *[point for schedule, repeats in (('1f1b', 1), ('interleaved_1f1b', 2), ('zb_h1', 1))
        for point in case(f'7b-{schedule}', {'pipeline4': {
            'mesh.stage': 4, 'mesh.fsdp': 2, 'mesh.data': 1, 'parallel.zero_stage': 3,
            'parallel.pipeline_microbatches': 4, 'parallel.pipeline_schedule': schedule,
            'parallel.pipeline_repeats': repeats}}, config='configs/pipeline.py:7b')],
      # A split other than the storage's blocks: the chunks' layers moved stage to stage.
      *case('7b-zb_h1-7997', {'pipeline4': {
          'mesh.stage': 4, 'mesh.fsdp': 2, 'mesh.data': 1, 'parallel.zero_stage': 3,
          'parallel.pipeline_microbatches': 4, 'parallel.pipeline_schedule': 'zb_h1',
          'parallel.pipeline_stage_layers': '7,9,9,7'}}, config='configs/pipeline.py:7b'),
      *case('7b-lora', {'zero3': LAYOUTS['zero3']}, config='configs/lora.py:7b'),
      *case('7b-qlora', {'zero3': LAYOUTS['zero3']}, config='configs/qlora.py:7b'),
      *case('20b-lora', {'zero3': LAYOUTS['zero3']}, config='configs/lora.py:20b'),
      *case('20b-qlora', {'zero3': LAYOUTS['zero3']}, config='configs/qlora.py:20b'),
      *case('7b-16k', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:7b',
            **{'train.seq_len': 16384, 'model.max_seq_len': 16384}),
      *case('small-fp32', {'zero3': LAYOUTS['zero3']}, config='configs/default.py',
            precision='fp32', **{'model.remat': 'none', 'train.batch_size': 16}),
      *case('7b-32k', {'zero3': LAYOUTS['zero3']}, config='configs/default.py:7b',
            **{'train.seq_len': 32768, 'model.max_seq_len': 32768}),
  ]
  # The recipes the planner chose verifying with XLA:CPU (issue 30), where not in the grid above.
  planned = [
      *case('7b-noremat-8mb', {'zero3_tp2': {**LAYOUTS['zero3'], 'mesh.tensor': 2}},
            config='configs/default.py:7b', **{'model.remat': 'none', 'train.batch_size': 32,
                                               'train.microbatches': 8}),
      *product(choices('model', {'70b-adam8-2mb': {
          'config': 'configs/default.py:70b', 'host_devices': 64, 'train.batch_size': 256,
          'train.microbatches': 2, 'precision': 'bf16_master', 'quant.adam_bits': 8}}),
               choices('devices', {64: {}}), choices('layout', {'zero3': LAYOUTS['zero3']})),
  ]
  one_device = product(choices('model', {
      '20b-qlora': {'config': 'configs/qlora.py:20b', 'host_devices': 1, 'train.batch_size': 1},
      # The default run (`python main.py`): the small preset in fp32 without remat.
      'small-fp32': {'config': 'configs/default.py', 'host_devices': 1, 'train.batch_size': 16,
                     'precision': 'fp32', 'model.remat': 'none'}}),
                       choices('devices', {1: {}}),
                       choices('layout', {'single': {'mesh.fsdp': 1, 'mesh.data': 1,
                                                     'mesh.tensor': 1}}))
  return dict(
      title='The memory estimate against the compiler: every layout, scale and feature',
      command='dry_run',
      config='configs/default.py',
      overrides={'precision': 'bf16_mixed', 'model.remat': 'full', 'train.microbatches': 1},
      points=[p for compiler in ([arg] if arg else list(COMPILERS))
              for p in compiled_by(compiler, [*grid, *cases, *planned, *one_device])],
      metrics=('params_m', 'compiled_gb', 'estimate_gb', 'estimate_error', 'wall_s'),
      charts=tuple(chart for compiler in ([arg] if arg else list(COMPILERS))
                   for chart in charts(compiler, [p.labels['model']
                                                  for p in [*cases, *planned, *one_device]])),
  )


def charts(compiler: str, case_models: list) -> list:
  """The grid's and the cases' error charts of one compiler's points."""
  name = COMPILERS[compiler]
  return [
      dict(file=f'error-{compiler}.png', x='devices', y='estimate_error', series='layout',
           panels='model', where={'model': list(MODELS), 'compiler': [name]}, logx=True, hline=5,
           hline_label='+5 %', ylabel='estimate - compiled (% of compiled)',
           title=f'The analytic estimate against {name}\'s per-device total as devices are added'),
      dict(file=f'cases-{compiler}.png', x='model', y='estimate_error', series='layout',
           kind='scatter', where={'model': case_models, 'compiler': [name]}, hline=5,
           hline_label='+5 %', ylabel='estimate - compiled (% of compiled)',
           title=f'The analytic estimate against {name}\'s per-device total: GPT-2 shapes, '
                 f'precisions, pipelines, LoRA, long context, the default run'),
  ]
