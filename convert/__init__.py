"""Hugging Face checkpoints in and out of our Transformer (Llama and GPT-2, safetensors).

Import: `HFCheckpoint(directory)` reads config.json into ModelConfig fields and streams each of our
parameters out of the safetensors files, converted to our layout. Export: `export_hf` writes a
directory that `transformers` loads with `from_pretrained`.
"""
from convert.errors import ConvertError
from convert.hf_checkpoint import HFCheckpoint
from convert.hf_config import SUPPORTED, arch_of
from convert.hf_export import SHARD_BYTES, export_hf
