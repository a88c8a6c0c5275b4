"""FSDP against DDP as models grow and GPUs are added: per-device memory of the compiled train
step against an 80 GB device, the collective bytes each device moves per step, and the TFLOP/s per
GPU the planner's cost model gives each layout on H100s (modelled, not measured).

  python -m sweep --sweep=sweeps/fsdp_vs_ddp.py --workdir=runs/sweep-fsdp-vs-ddp

Dry runs only (compiled on simulated CPU devices, nothing allocated): four model sizes (the 100m,
Llama-3.2-1B, Llama-2-7B and Llama-2-70B presets) x 8, 64 and 512 devices x five layouts: DDP,
ZeRO-1, ZeRO-2, ZeRO-3 and ZeRO-3 with 4-way tensor parallelism. Every point: bf16 compute with
fp32 master weights and Adam (bf16_mixed), full remat, one sequence per device (the preset's
length: 512, 2048, 4096, 4096 tokens), one microbatch.
"""
from sweep.grid import axis, choices, product, zipped

MODELS = {size: {'config': f'configs/default.py:{size}'} for size in ('100m', '1b', '7b', '70b')}
DEVICES = (8, 64, 512)
LAYOUTS = {
    'ddp': {'mesh.data': -1, 'mesh.fsdp': 1, 'mesh.tensor': 1, 'parallel.zero_stage': 0},
    'zero1': {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 1, 'parallel.zero_stage': 1},
    'zero2': {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 1, 'parallel.zero_stage': 2},
    'zero3': {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 1, 'parallel.zero_stage': 3},
    'zero3_tp4': {'mesh.data': 1, 'mesh.fsdp': -1, 'mesh.tensor': 4, 'parallel.zero_stage': 3},
}


def get_sweep():
  devices = zipped(axis('host_devices', DEVICES, label='devices'),
                   axis('train.batch_size', DEVICES, label=''))   # one sequence per device
  return dict(
      title='FSDP (ZeRO-1/2/3) against DDP: per-device memory, traffic and modelled speed',
      command='dry_run',
      config='configs/default.py',
      overrides={'precision': 'bf16_mixed', 'model.remat': 'full', 'train.microbatches': 1},
      points=product(choices('model', MODELS), devices, choices('layout', LAYOUTS)),
      metrics=('params_m', 'compiled_gb', 'fits', 'estimate_gb', 'estimate_gpu_gb', 'collective_gb',
               'modelled_step_s', 'modelled_tflops', 'wall_s'),
      target='H100-80GB',
      charts=(
          dict(file='memory.png', x='devices', y='compiled_gb', series='layout', panels='model',
               logx=True, logy=True, hline=80, hline_label='80 GB (one H100)',
               ylabel='compiled train step per device (GB)',
               title='Per-device memory of the train step (compiled, XLA:CPU) as devices are added'),
          dict(file='collectives.png', x='devices', y='collective_gb', series='layout',
               panels='model', logx=True, logy=True,
               ylabel='collective bytes per step per device (GB)',
               title='Collective buffers per device per step (all-gather + reduce-scatter + '
                     'all-reduce, compiled on XLA:CPU, which gathers bf16 weights in fp32)'),
          dict(file='tflops.png', x='devices', y='modelled_tflops', series='layout',
               panels='model', logx=True,
               ylabel='TFLOP/s per GPU (MODELLED: plan/cost.py)',
               title='Modelled, not measured: model TFLOP/s per H100 from the planner\'s cost '
                     'model (45 % MFU compute, ring collectives), fits or not'),
      ),
  )
