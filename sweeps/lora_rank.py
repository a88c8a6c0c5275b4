"""LoRA and QLoRA rank on one of our checkpoints: validation loss against trainable parameters
and per-device memory, with full fine-tuning as the reference.

  python -m sweep --sweep=sweeps/lora_rank.py --workdir=runs/sweep-lora-rank

The base is the default run, trained first by the sweep itself (`before`: DIR/before/base; 500
steps on the Python standard library). Each point fine-tunes it for 100 steps of 16 x 128 bytes on
the CPython C headers of the running interpreter (`sysconfig`'s include directory: a domain the
base has not seen, on every machine, nothing downloaded; a fifth of its files held out, so that the
evaluation has tens of thousands of tokens), adapters on every projection with
alpha = 2 x rank, peak learning rate 5e-3 (the best of the LoRA rows in WORKSPACE "LoRA vs full
fine-tuning"); full fine-tuning at 1e-3, its best there. QLoRA: NF4 base, bf16 compute, one device.
"""
import os
import sysconfig

from sweep.grid import axis, choices, product, zipped

HEADERS = os.path.join(sysconfig.get_paths()['include'], '**', '*.h')
RANKS = (1, 4, 16, 64)


def get_sweep():
  adapters = product(
      choices('recipe', {'lora': {'config': 'configs/lora.py'},
                         'qlora': {'config': 'configs/qlora.py', 'host_devices': 1,
                                   'mesh.fsdp': 1}}),
      zipped(axis('lora.rank', RANKS), axis('lora.alpha', [2.0 * r for r in RANKS], label='')))
  full = choices('recipe', {'full': {'config': 'configs/default.py', 'train.steps': 100,
                                     'train.learning_rate': 1e-3}})
  return dict(
      title='LoRA / QLoRA rank: fine-tuned loss against trainable parameters and memory',
      command='train',
      config='configs/lora.py',
      before={'base': {'config': 'configs/default.py'}},
      overrides={'init_from': 'run:{base}', 'data.path': HEADERS, 'data.val_fraction': 0.2,
                 'lora.targets': '.*',
                 'train.learning_rate': 5e-3, 'train.warmup_steps': 5},
      points=[*adapters, *full],
      metrics=('trainable_m', 'final_loss', 'final_loss_sem', 'compiled_gb', 'tokens_per_sec',
               'wall_s'),
      charts=(
          dict(file='loss_vs_trainable.png', x='trainable_m', y='final_loss', yerr='final_loss_sem',
               series='recipe', logx=True,
               title='Fine-tuned validation loss vs trainable parameters (100 steps, C headers)'),
          dict(file='memory_vs_trainable.png', x='trainable_m', y='compiled_gb', series='recipe',
               logx=True, title='Compiled train step per device vs trainable parameters'),
      ),
  )
