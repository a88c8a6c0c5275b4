"""fp8 quantization-aware training: e4m3 activations and weights, e5m2 gradients, scales from
each tensor's current absolute maximum (Qwix). This CPU emulates fp8; a speed-up needs an H100.

  python main.py --config=configs/fp8.py
  python main.py --config=configs/fp8.py --config.quant.fp8_scaling=delayed   # scales from a 16-step amax history
  python main.py --config=configs/fp8.py --config.quant.block_size=32   # one scale per 32 inputs instead of per channel
  python main.py --config=configs/fp8.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('fp8', preset)
