"""Post-training quantization of a trained run: restore its weights, store the dense kernels
quantized (quant/weights.py), and save or restore the quantized model on its own.

A quantized model is saved as `<dir>/weights` (orbax, the model's arrays: float norms and
embeddings, quantized kernels) beside `<dir>/quantized.json` (the run's config and the format), so
it restores without the run it came from.
"""
import json
import os

import jax
import ml_collections
import orbax.checkpoint as ocp
from flax import nnx

from models.dense import quantize_weights
from precision.policy import Policy
from train import checks
from train.checkpoint import CheckpointError, Checkpointer, DigestMismatch
from train.state import build_model


def run_config(workdir: str, defaults: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """The config a run saved, laid over `defaults` (so keys added since the run take their default)."""
  path = os.path.join(workdir, 'config.json')
  if not os.path.isfile(path):
    raise CheckpointError(f'{path} does not exist; --workdir must be a directory a training run '
                          f'wrote (config.json and checkpoints/)')
  with open(path) as f:
    saved = json.load(f)
  config = ml_collections.ConfigDict(defaults.to_dict())   # plain values, no field references

  def merge(node, values):
    for key, value in values.items():
      if isinstance(value, dict) and key in node and isinstance(node[key], ml_collections.ConfigDict):
        merge(node[key], value)
      else:
        node[key] = value
  merge(config, saved)
  return config


def restore_weights(workdir: str, config, step: int | None = None, with_setup: bool = False):
  """(trainable params, frozen LoRA base or {}) of `workdir`'s latest checkpoint (or `step`),
  on the default device; `with_setup`: and the one-device layout they were restored into."""
  from train import run   # run.py is the layer above; imported here only to rebuild the layout
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):   # checked first: the checkpoint manager would create it
    raise CheckpointError(f'{directory} does not exist; train first')
  checkpoints = Checkpointer(directory, keep=1 << 30)
  step = checkpoints.latest_step() if step is None else step
  if step is None:
    raise CheckpointError(f'{workdir}/checkpoints holds no checkpoint; train first')
  # One device, whatever mesh the run trained on: a checkpoint restores onto any layout.
  one_device = ml_collections.ConfigDict(config.to_dict())
  one_device.mesh = {'data': 1, 'fsdp': 1, 'tensor': 1}
  s = run.setup(one_device, devices=jax.devices()[:1])
  checkpoints.check_compatible(step, s.layout.abstract, run.checkpoint_meta(s))
  state, data = checkpoints.restore(step, s.layout.abstract, s.layout.unpadded)
  try:   # a checkpoint that decodes to other values than were saved is refused, not used
    checkpoints.verify(step, state, data, s.layout.unpadded)
  except DigestMismatch as e:
    raise CheckpointError(f'{checkpoints.path(step)}: {e}') from None
  finally:
    checkpoints.close()
  weights = state['params'], state.get('frozen', {})
  return (*weights, s) if with_setup else weights


def restore_params(workdir: str, config, step: int | None = None) -> dict:
  """The trained parameters (a pure dict, on the default device) of a run without LoRA."""
  if config.lora.rank:
    raise CheckpointError(f'{workdir} is a LoRA run (lora.rank={config.lora.rank}): its weights are '
                          f'a frozen base and adapters, which post-training quantization does not '
                          f'read; export them merged with python -m cli.export_hf')
  return restore_weights(workdir, config, step)[0]


def build_quantized(config, policy: Policy, params: dict | None, fmt: str | None) -> nnx.Module:
  """The model with `params` (None: abstract shapes only), its kernels stored in `fmt` (None:
  left in floats, cast to the policy's param dtype)."""
  model_cfg = checks.model_config(config)

  def make(params):
    model = build_model(model_cfg, policy, config.train.seed)
    if params is not None:
      dtype_params = jax.tree.map(lambda p: p.astype(policy.param_dtype), params)
      nnx.update(model, nnx.State(dtype_params))
    return model if fmt is None else quantize_weights(model, fmt)

  if params is None:
    return nnx.eval_shape(lambda: make(None))
  # One program, not one compile per operation (eagerly, this was 40 % of bench.ptq's CPU).
  return nnx.jit(make)(params)


def save_quantized(model: nnx.Module, config, fmt: str, directory: str) -> None:
  """Refuses an existing directory: nothing already saved is overwritten."""
  directory = os.path.abspath(directory)
  if os.path.exists(directory):
    raise CheckpointError(f'{directory} already exists; choose a new directory for the quantized '
                          f'model')
  checkpointer = ocp.StandardCheckpointer()
  checkpointer.save(os.path.join(directory, 'weights'), nnx.to_pure_dict(nnx.state(model)))
  checkpointer.wait_until_finished()
  with open(os.path.join(directory, 'quantized.json'), 'w') as f:
    json.dump({'format': fmt, 'precision': config.precision, 'config': config.to_dict()}, f,
              indent=1)


def restore_quantized(directory: str) -> tuple[nnx.Module, ml_collections.ConfigDict, str]:
  """(model, config, format) from a directory `save_quantized` wrote."""
  meta_path = os.path.join(directory, 'quantized.json')
  if not os.path.isfile(meta_path):
    raise CheckpointError(f'{meta_path} does not exist; point at a directory save_quantized wrote')
  with open(meta_path) as f:
    meta = json.load(f)
  config = ml_collections.ConfigDict(meta['config'])
  abstract = build_quantized(config, checks.policy(config), None, meta['format'])
  graphdef, abstract_state = nnx.split(abstract)
  target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                        nnx.to_pure_dict(abstract_state))
  restored = ocp.StandardCheckpointer().restore(os.path.join(directory, 'weights'), target)
  nnx.replace_by_pure_dict(abstract_state, restored)
  return nnx.merge(graphdef, abstract_state), config, meta['format']
