"""int8 quantization-aware training: int8 x int8 -> int32 matmuls with per-token activation and
per-channel weight scales (Qwix); the gradients stay in the compute dtype.

  python main.py --config=configs/int8.py
  python main.py --config=configs/int8.py --config.quant.int8_backward=True   # the matmul gradients in int8 too
  python main.py --config=configs/int8.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('int8', preset)
