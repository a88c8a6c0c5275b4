"""The fine-tuning recipes (LoRA, QLoRA) on top of the default experiment, as one table."""
import ml_collections

from configs import default

FINETUNES = {
    # name: (precision, quant, lora, mesh and zero stage, what it is)
    'lora': (None, {}, dict(rank=8, alpha=16.0, dropout=0.05), None,
             'LoRA: rank-8 adapters on attention query/value, base frozen'),
    'qlora': ('bf16_mixed', dict(weights='nf4'), dict(rank=8, alpha=16.0, dropout=0.05),
              (dict(data=1, fsdp=-1, tensor=1), 3),
              'QLoRA: NF4 frozen base (ZeRO-3 sharded), rank-8 adapters, bf16 compute'),
}


def finetune_config(recipe: str, preset: str | None) -> ml_collections.ConfigDict:
  precision, quant, lora, layout, description = FINETUNES[recipe]
  config = default.get_config(preset)
  config.name = f'{recipe}:{preset or "small"}'
  config.description = description
  if precision is not None:   # None: keep the preset's own precision
    config.precision = precision
  config.quant.update(quant)
  config.lora.update(lora)
  if layout is not None:
    config.mesh, config.parallel.zero_stage = layout
    config.host_devices = 8
  # A fine-tune is short: a fifth of the preset's steps (its warmup, evaluations and checkpoints
  # follow by reference).
  config.train.steps = max(config.train.steps // 5, 20)
  return config
