"""int4 weights (per-channel absmax scales), bf16 activations; the gradient is straight-through.

  python main.py --config=configs/int4.py
  python main.py --config=configs/int4.py --config.quant.learned_scale=True   # learned step sizes (LSQ)
  python main.py --config=configs/int4.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('int4', preset)
