"""The fine-tuning recipes (LoRA, QLoRA) on top of the default experiment, as one table."""
import ml_collections

from configs import default

_ADAPTERS = {'lora.rank': 8, 'lora.alpha': 16.0, 'lora.dropout': 0.05}
FINETUNES = {
    # name: (dotted-key settings, what it is); lora keeps the preset's own precision
    'lora': (_ADAPTERS, 'LoRA: rank-8 adapters on attention query/value, base frozen'),
    'qlora': ({**_ADAPTERS, 'precision': 'bf16_mixed', 'quant.weights': 'nf4',
               'mesh': dict(data=1, fsdp=-1, tensor=1), 'parallel.zero_stage': 3,
               'host_devices': 8},
              'QLoRA: NF4 frozen base (ZeRO-3 sharded), rank-8 adapters, bf16 compute'),
}


def finetune_config(recipe: str, preset: str | None) -> ml_collections.ConfigDict:
  config = default.variant(recipe, preset, *FINETUNES[recipe])
  # A fine-tune is short: a fifth of the preset's steps (its warmup, evaluations and checkpoints
  # follow by reference).
  config.train.steps = max(config.train.steps // 5, 20)
  return config
