"""Every shipped config as a user starts it on one node of 8 H100s: whether its step compiles for
the GPU, its compiled per-device memory, and the analytic estimate beside it. Compiled by XLA:GPU
on any machine (`--dry_run --target=8xH100-80GB`: the CUDA plugin, requirements-gpu-compile.txt),
nothing allocated.

  python -m sweep --sweep=sweeps/configs_gpu.py --workdir=runs/sweep-configs-gpu

Each config of configs/ that trains (the layouts, precisions, quantized and fine-tuning recipes,
the pipeline) at its default preset (`small`) and at `1b` (64 x 2048 tokens in 8 microbatches),
each in its own precision and layout: the GPU paths a CPU test does not take (cuDNN's attention,
XLA:GPU's partitioner) on the shapes users start from. A point that fails to compile is a bug:
the sweep lists it as failed, with its log.
"""
from sweep.grid import Point

CONFIGS = ('default', 'ddp', 'zero1', 'zero2', 'fsdp', 'tp', 'fsdp_tp', 'pipeline', 'bf16',
           'fp8', 'int8', 'int4', 'llm_int8', 'adam8bit', 'lora', 'qlora')
PRESETS = ('small', '1b')
GPUS = 8
GPU = 'H100-80GB'


def get_sweep():
  points = [Point({'config': name, 'preset': preset}, {'config': f'configs/{name}.py:{preset}'})
            for name in CONFIGS for preset in PRESETS]
  return dict(
      title=f'Every shipped config compiled for {GPUS} {GPU}s: memory against the estimate',
      command='dry_run',
      config='configs/default.py',
      overrides={'host_devices': GPUS, 'target': f'{GPUS}x{GPU}'},
      points=points,
      metrics=('params_m', 'compiled_gb', 'estimate_gb', 'estimate_error', 'wall_s'),
  )
