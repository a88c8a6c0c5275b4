"""Adam with 8-bit moments (block-wise dynamic quantization, blocks of 2048 values; tensors under
4096 values keep fp32 moments).

  python main.py --config=configs/adam8bit.py
  python main.py --config=configs/adam8bit.py --config.precision=bf16   # bf16 weights + 8-bit Adam: 6 bytes per parameter
  python main.py --config=configs/adam8bit.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('adam8bit', preset)
