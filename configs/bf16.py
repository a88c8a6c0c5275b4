"""bf16 mixed precision: bf16 matmuls and activations, fp32 master weights and Adam moments.

  python main.py --config=configs/bf16.py
  python main.py --config=configs/bf16.py --config.precision=bf16_master   # bf16 weights, fp32 master in the optimizer
  python main.py --config=configs/bf16.py --config.precision=bf16   # weights and the update in bf16 too
  python main.py --config=configs/bf16.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('bf16', preset)
