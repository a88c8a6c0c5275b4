"""Adam with 8-bit moments (block-wise dynamic quantization, blocks of 2048 values; tensors under
4096 values keep fp32 moments). Combine with any layout or precision by overrides.

  python main.py --config=configs/adam8bit.py
  python main.py --config=configs/adam8bit.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs import default


def get_config(preset: str | None = None):
  config = default.get_config(preset)
  config.name = f'adam8bit:{preset or "small"}'
  config.description = 'AdamW with 8-bit block-wise quantized moments'
  config.quant.adam_bits = 8
  return config
