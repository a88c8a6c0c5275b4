"""The precision and quantization recipes: each is a few `precision` / `quant.*` settings on top of
the default experiment, combinable with any parallel layout by overrides, e.g.

  python main.py --config=configs/int8.py --host_devices=8 --config.mesh.data=1 \
      --config.mesh.fsdp=8 --config.parallel.zero_stage=3
"""
import ml_collections

from configs import default

RECIPES = {
    # name: (dotted-key settings, what it is); adam8bit keeps the preset's own precision
    'bf16': ({'precision': 'bf16_mixed'}, 'bf16 compute, fp32 master weights and Adam'),
    'fp8': ({'precision': 'bf16_mixed', 'quant.mode': 'fp8'},
            'fp8 matmuls: e4m3 operands, e5m2 gradients, current absmax scaling'),
    'int8': ({'precision': 'bf16_mixed', 'quant.mode': 'int8'},
             'int8 x int8 -> int32 matmuls (per-token and per-channel absmax scales)'),
    'int4': ({'precision': 'bf16_mixed', 'quant.mode': 'int4'},
             'int4 weights (per-channel absmax), bf16 activations'),
    'llm_int8': ({'precision': 'bf16_mixed', 'quant.mode': 'llm_int8', 'quant.threshold': 6.0},
                 'LLM.int8(): outlier columns in bf16, the rest int8'),
    'adam8bit': ({'quant.adam_bits': 8}, 'AdamW with 8-bit block-wise quantized moments'),
}


def recipe_config(recipe: str, preset: str | None) -> ml_collections.ConfigDict:
  return default.variant(recipe, preset, *RECIPES[recipe])
