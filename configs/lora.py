"""LoRA fine-tuning: rank-8 adapters on the attention query and value projections (the LoRA
paper's targets), everything else frozen (no gradients, no optimizer state, stored in the compute
dtype). The base comes from `init_from`:

  python main.py --config=configs/default.py --workdir=runs/base            # or any earlier run
  python main.py --config=configs/lora.py --config.init_from=run:runs/base
  python main.py --config=configs/lora.py --config.init_from=hf:/path/to/llama-or-gpt2
  python main.py --config=configs/lora.py --config.lora.targets='.*(attention|mlp)/.*'   # all projections
  python main.py --config=configs/lora.py:7b --dry_run     # the memory of a 7B LoRA step, no weights needed

The text is the embedded corpus, or yours with --config.data.path='/my/texts/*.txt'.
"""
from configs.finetune import finetune_config


def get_config(preset: str | None = None):
  return finetune_config('lora', preset)
