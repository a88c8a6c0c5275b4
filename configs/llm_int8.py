"""LLM.int8(): input columns holding any |x| > quant.threshold (6.0) go through a bf16 matmul,
the rest through int8 with vector-wise scales; the two products are summed.

  python main.py --config=configs/llm_int8.py
  python main.py --config=configs/llm_int8.py --config.quant.threshold=4.0   # more columns go through bf16
  python main.py --config=configs/llm_int8.py:7b --dry_run --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
from configs.recipes import recipe_config


def get_config(preset: str | None = None):
  return recipe_config('llm_int8', preset)
