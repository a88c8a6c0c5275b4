"""QLoRA: LoRA adapters over a frozen base whose dense kernels are stored in NF4 with double
quantization (0.52 bytes per weight; `quant.weights=int8` or `int4` also work), bf16 compute,
sharded ZeRO-3 over the fsdp axis (8 simulated devices without an accelerator) - the quantized
base shards too.

  python main.py --config=configs/default.py --workdir=runs/base            # or any earlier run
  python main.py --config=configs/qlora.py --config.init_from=run:runs/base
  python main.py --config=configs/qlora.py --config.init_from=hf:/path/to/llama-or-gpt2
  python main.py --config=configs/qlora.py:7b --dry_run --host_devices=1 --config.mesh.fsdp=1
      # a 7B QLoRA step on one device: its memory, known before the weights are at hand
"""
from configs.finetune import finetune_config


def get_config(preset: str | None = None):
  return finetune_config('qlora', preset)
