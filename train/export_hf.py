"""Export a run of ours as a Hugging Face checkpoint (safetensors + config.json) that
`transformers` loads with `from_pretrained`: LlamaForCausalLM for the default architecture,
GPT2LMHeadModel for a model with GPT-2's options. LoRA adapters are merged into their kernels
(a quantized QLoRA base is dequantized first), so the export is a plain dense model.

  python -m train.export_hf --workdir=runs/my-run --out=exported/ [--dtype=bfloat16] [--step=N]
"""
import os
import sys

import jax.numpy as jnp
from absl import app, flags, logging
from flax import nnx, traverse_util

from configs import default
from models.dense import bake_learned_grid, dequantize_weights
from models.lora import merge
from train import checks
from train.checkpoint import CheckpointError
from train.ptq import restore_weights, run_config

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run to export (its config.json and checkpoints/).')
_OUT = flags.DEFINE_string('out', None, 'A new directory for the Hugging Face checkpoint.')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16', 'float16'],
                           'The dtype of the exported tensors.')
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint step; default the latest.')


def merged_params(config, params: dict, frozen: dict, dtype: str = 'float32') -> dict:
  """The float parameters of the model with every adapter merged in (its kernel in `dtype`, the
  export's) and every LSQ kernel on its learned grid (a pure dict): the weights the run's forward
  pass multiplies by."""
  spec = checks.model_spec(config)
  graphdef = nnx.split(nnx.eval_shape(spec.build), spec.trainable, ...)[0]
  merged = merge(nnx.merge(graphdef, params, frozen), jnp.dtype(dtype))
  model = bake_learned_grid(dequantize_weights(merged))
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def export_run(workdir: str, out_dir: str, dtype: str = 'float32', step: int | None = None) -> str:
  from convert import export_hf
  config = run_config(workdir, default.get_config())
  params, frozen = restore_weights(workdir, config, step)
  weights = merged_params(config, params, frozen, dtype)
  training_only = ('amax_history', 'step_size')   # state of the training, not model weights
  weights = traverse_util.unflatten_dict({
      k: v for k, v in traverse_util.flatten_dict(weights).items() if not set(k) & set(training_only)})
  export_hf(weights, checks.model_config(config), out_dir, dtype)
  return out_dir


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # orbax narrates every restore at INFO
  from convert import ConvertError
  if not _WORKDIR.value or not _OUT.value:
    sys.exit('error: --workdir=RUN and --out=NEW_DIR are both required')
  try:
    out = export_run(_WORKDIR.value, _OUT.value, _DTYPE.value, _STEP.value)
  except (CheckpointError, ConvertError, checks.ConfigError) as e:
    sys.exit(f'error: {e}')
  print(f'exported    {os.path.abspath(out)}')


if __name__ == '__main__':
  app.run(main)
