"""Export a run of ours as a Hugging Face checkpoint (safetensors + config.json) that
`transformers` loads with `from_pretrained`: LlamaForCausalLM for the default architecture,
GPT2LMHeadModel for a model with GPT-2's options. LoRA adapters are merged into their kernels
(a quantized QLoRA base is dequantized first), so the export is a plain dense model. The program: `python -m cli.export_hf`.
"""
import jax.numpy as jnp
from flax import nnx, traverse_util

from configs import default
from models.dense import bake_learned_grid, dequantize_weights
from models.lora import merge
from train import checks
from train.ptq import restore_weights, run_config

def merged_params(config, params: dict, frozen: dict, dtype: str = 'float32') -> dict:
  """The float parameters of the model with every adapter merged in (its kernel in `dtype`, the
  export's) and every LSQ kernel on its learned grid (a pure dict): the weights the run's forward
  pass multiplies by."""
  spec = checks.model_spec(config)
  graphdef = nnx.split(spec.abstract(), spec.trainable, ...)[0]
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


if __name__ == '__main__':   # the old command; the program is cli/export_hf.py
  import runpy
  runpy.run_module('cli.export_hf', run_name='__main__', alter_sys=True)
