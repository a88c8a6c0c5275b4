"""The GPU estimate at the shapes people train at: 8 sequences of 2,048 tokens a device, against
XLA:GPU's compiled total (compile-only GPUs, `--dry_run --target`: the CUDA plugin,
requirements-gpu-compile.txt).

  python -m sweep --sweep=sweeps/estimate_rows.py --workdir=runs/sweep-estimate-rows

sweeps/estimate.py runs one sequence a device, where the layers' backward makes the peak. Here the
[tokens, vocabulary] logits make it (the head and the loss), and what XLA:GPU holds beside them
decides the estimate: the 1b preset on one H200 in three precisions x three remat policies, and on
8 H100s under DDP and ZeRO-1, 2 and 3 x the same remats (64 sequences a step); 7b under ZeRO-3 on 8
H100s. Dry runs only; the compiled figure is the installed jax's.
"""
from sweep.grid import choices, product

REMATS = {remat: {'model.remat': remat} for remat in ('none', 'dots', 'full')}
LAYOUTS = {
    'ddp': {'mesh.data': -1, 'mesh.fsdp': 1, 'parallel.zero_stage': 0},
    'zero1': {'mesh.data': 1, 'mesh.fsdp': -1, 'parallel.zero_stage': 1},
    'zero2': {'mesh.data': 1, 'mesh.fsdp': -1, 'parallel.zero_stage': 2},
    'zero3': {'mesh.data': 1, 'mesh.fsdp': -1, 'parallel.zero_stage': 3},
}


def get_sweep():
  one_gpu = product(
      choices('model', {'1b': {'config': 'configs/default.py:1b'}}),
      choices('target', {'1xH200-141GB': {'target': '1xH200-141GB', 'train.batch_size': 8,
                                          'mesh.data': 1, 'mesh.fsdp': 1,
                                          'parallel.zero_stage': 0}}),
      choices('precision', {p: {'precision': p} for p in ('bf16_mixed', 'bf16_master', 'bf16')}),
      choices('remat', REMATS))
  eight_gpus = product(
      choices('model', {'1b': {'config': 'configs/default.py:1b'}}),
      choices('target', {'8xH100-80GB': {'target': '8xH100-80GB', 'train.batch_size': 64}}),
      choices('layout', LAYOUTS), choices('remat', REMATS))
  seven_b = product(
      choices('model', {'7b': {'config': 'configs/default.py:7b'}}),
      choices('target', {'8xH100-80GB': {'target': '8xH100-80GB', 'train.batch_size': 64}}),
      choices('layout', {'zero3': LAYOUTS['zero3']}),
      choices('remat', {k: REMATS[k] for k in ('dots', 'full')}))
  return dict(
      title='The GPU estimate at 8 sequences a device, against XLA:GPU',
      command='dry_run',
      config='configs/default.py:1b',
      overrides={'precision': 'bf16_mixed', 'train.seq_len': 2048, 'train.microbatches': 1,
                 'mesh.tensor': 1},
      points=[*one_gpu, *eight_gpus, *seven_b],
      metrics=('params_m', 'compiled_gb', 'estimate_gb', 'estimate_error', 'wall_s'),
  )
