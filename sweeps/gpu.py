"""The GPU suite's measurements (`python -m bench.gpu` runs them, with the 20B claim): the train step
of the largest presets that fit one device, under every precision and quantization recipe and
every attention, timed by bench.train_step, one process per case.

  python -m sweep --sweep=sweeps/gpu.py:H100-80GB --workdir=runs/gpu    # the cases alone
  python -m sweep --sweep=sweeps/gpu.py:smoke --workdir=runs/gpu-smoke  # tiny shapes, any machine

The argument is the GPU the modelled columns refer to (configs/hardware.py; bench.gpu passes the
device's own), or `smoke`: the tiny preset at 8 x 64 tokens, a few steps, no cuDNN case, so that
the plumbing runs on a CPU in about a minute, or `dry_run`: the full-size cases compiled on this
machine's CPU (nothing allocated), for their compiled figures and estimates before a GPU is at hand:

  python -m sweep --sweep=sweeps/gpu.py:dry_run --workdir=runs/gpu-dry-run

Shapes (one device): the 1b preset (Llama-3.2-1B, 1.24 B parameters with its 128k vocabulary) at 8
sequences of 2048 tokens, remat `dots` (the matmul outputs kept, the rest recomputed: the policy
MaxText's published MFU runs use), one microbatch; the 7b preset with LoRA and QLoRA (NF4) at 8 x
2048, full remat. Rows are single documents (no packing): the attentions run their plain causal
kernels. The analytic estimate on a GPU puts the 1b cases at 46-54 GB and the 7b ones at 16-25 GB.
"""
from sweep.grid import choices

BF16 = {'precision': 'bf16_mixed'}
RECIPES = {
    'bf16_mixed': BF16,
    'bf16_master': {'precision': 'bf16_master'},
    'fp8': {**BF16, 'quant.mode': 'fp8'},
    'fp8_delayed': {**BF16, 'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed'},
    'int8': {**BF16, 'quant.mode': 'int8'},
    'adam8bit': {**BF16, 'quant.adam_bits': 8},
}
# The attentions besides the default's (`auto`: cuDNN on a GPU in bf16, flash elsewhere), which
# the recipe cases run with.
OTHER_ATTENTIONS = {'gpu': ('xla', 'flash'), 'smoke': ('xla',)}
SHAPES = {   # config file:preset -> shape overrides (full size, and smoke)
    '1b': ({'train.batch_size': 8, 'train.seq_len': 2048, 'model.remat': 'dots'},
           {'train.batch_size': 8, 'train.seq_len': 64, 'model.remat': 'dots'}),
    '7b': ({'train.batch_size': 8, 'train.seq_len': 2048, 'model.remat': 'full'},
           {'train.batch_size': 8, 'train.seq_len': 64, 'model.remat': 'full'}),
}


def cases(smoke: bool) -> dict:
  """case name -> overrides (config included): every recipe at 1b with the default attention
  (cuDNN on a GPU in bf16), the other attentions with bf16_mixed, and LoRA / QLoRA at 7b."""
  preset = (lambda name: 'tiny') if smoke else (lambda name: name)
  shape = lambda name: SHAPES[name][1 if smoke else 0]
  one_device = {'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 1,
                'parallel.zero_stage': 0, 'host_devices': 0, 'train.microbatches': 1,
                'data.packing': False}
  out = {}
  for name, recipe in RECIPES.items():
    out[f'1b_{name}'] = {'config': f'configs/default.py:{preset("1b")}', **one_device,
                         **shape('1b'), **recipe}
  for attention in OTHER_ATTENTIONS['smoke' if smoke else 'gpu']:
    out[f'1b_bf16_mixed_{attention}'] = {**out['1b_bf16_mixed'], 'model.attention': attention}
  for name in ('lora', 'qlora'):
    out[f'7b_{name}'] = {'config': f'configs/{name}.py:{preset("7b")}', **one_device,
                         **shape('7b'), **BF16}
  return out


def get_sweep(arg: str | None = None):
  smoke = arg == 'smoke'
  if arg == 'dry_run':
    return dict(title='GPU suite cases compiled on this machine (dry runs, nothing allocated)',
                command='dry_run', config='configs/default.py',
                points=choices('case', cases(smoke=False)),
                metrics=('compiled_gb', 'estimate_gb', 'estimate_gpu_gb', 'params_m', 'trainable_m',
                         'wall_s'))
  return dict(
      title=('GPU suite (smoke: tiny shapes)' if smoke else 'GPU suite') + ': step time, MFU and '
            'peak memory against the estimate, per recipe and attention',
      command='bench',
      config='configs/default.py',
      # A smoke run checks the plumbing: its MFU is against a small matmul's rate (bench.train_step
      # measures 2048^2 on a CPU: 11 of them, 7 CPU-s on a 2-core EPYC, twice for bf16 compute).
      overrides=({'bench_steps': 3, 'bench_warmup': 1, 'bench_matmul_size': 256} if smoke
                 else {'bench_steps': 20, 'bench_warmup': 3}),
      points=choices('case', cases(smoke)),
      metrics=('attention', 'step_ms', 'tokens_per_sec', 'mfu_peak', 'mfu_peak_causal',
               'mfu_peak_fp8', 'mfu',
               'peak_gb', 'compiled_gb', 'estimate_gpu_gb', 'peak_vs_estimate', 'modelled_step_s',
               'modelled_vs_measured', 'calibrated_mfu', 'params_m', 'trainable_m', 'wall_s'),
      target='H100-80GB' if smoke or arg is None else arg,
  )
