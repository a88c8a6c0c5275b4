"""Where a fresh run's weights come from (`init_from`): random (''), a local Hugging Face Llama or
GPT-2 checkpoint ('hf:DIR'), or the latest checkpoint of an earlier run of ours ('run:DIR').

The model's shape is the source's (read from its config.json before anything is built). The base
weights are read and placed one tensor at a time, each straight into its sharding on the current
mesh, and (QLoRA) quantized as soon as it is on the devices, so neither the host nor the devices
ever hold two copies of the model, and a quantized base never exists whole in floats. What the
source does not hold (LoRA adapters, fp8 amax histories) comes from the random initialiser,
jitted without the base so that XLA drops the random base altogether. What depends on the weights
is made from the loaded ones: LSQ step sizes (2 mean|w| / sqrt(qmax) of each loaded kernel's output
channel), and the optimizer state (an fp32 master copy, where the policy keeps one, starts as the
loaded weights in their stored dtype).
"""
import dataclasses
import json
import os
from typing import Callable

import jax
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from models import ModelConfig
from models.config import COMPUTE_FIELDS
from models.lora import dense_paths
from parallel.sharding import logical_axes_tree, shardings_for
from quant import lsq
from quant.weights import quantize_parts
from train.checkpoint import Checkpointer

KINDS = ('hf', 'run')


class InitError(ValueError):
  pass


@dataclasses.dataclass
class Source:
  """Base weights by parameter path: `read(path, abstract)` returns the array, placed as
  `abstract` (a ShapeDtypeStruct with a sharding) says; `check(path, shape)` raises InitError
  naming the tensor and both shapes where they differ, reading no tensor data."""
  description: str
  model_fields: dict
  read: Callable[[tuple, jax.ShapeDtypeStruct], jax.Array]
  check: Callable[[tuple, tuple], None]


def open_source(config) -> Source | None:
  """The source `config.init_from` names, checked (None for a random start)."""
  spec = config.init_from
  if not spec:
    return None
  kind, sep, path = spec.partition(':')
  if not sep or kind not in KINDS or not path:
    raise InitError(f'init_from={spec!r}; allowed: "" (random), "hf:DIR" (a Hugging Face '
                    f'checkpoint directory) or "run:DIR" (a workdir of an earlier run)')
  path = os.path.expanduser(path)
  return _hf_source(path) if kind == 'hf' else _run_source(path)


def _hf_source(directory: str) -> Source:
  from convert import ConvertError, HFCheckpoint
  try:
    checkpoint = HFCheckpoint(directory)
    fields = checkpoint.model_fields()
  except ConvertError as e:
    raise InitError(str(e)) from None

  def read(path, abstract):
    try:
      host = checkpoint.read(path, abstract.shape, abstract.dtype)
    except ConvertError as e:
      raise InitError(str(e)) from None
    return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda i: host[i])

  def check(path, shape):
    try:
      checkpoint.check(path, shape)
    except ConvertError as e:
      raise InitError(str(e)) from None

  return Source(f'{checkpoint.arch} checkpoint {os.path.abspath(directory)}', fields, read, check)


def _run_source(workdir: str) -> Source:
  config_path = os.path.join(workdir, 'config.json')
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isfile(config_path) or not os.path.isdir(directory):
    raise InitError(f'init_from=run:{workdir}: no config.json and checkpoints/ there; point it at '
                    f'the workdir of an earlier training run')
  with open(config_path) as f:
    saved = json.load(f)
  if saved.get('lora', {}).get('rank', 0):
    raise InitError(f'init_from=run:{workdir} is a LoRA run (lora.rank={saved["lora"]["rank"]}); '
                    f'export it merged (python -m train.export_hf) and use init_from=hf:DIR')
  checkpoints = Checkpointer(directory, keep=1 << 30)
  step = checkpoints.latest_step()
  checkpoints.close()
  if step is None:
    raise InitError(f'init_from=run:{workdir}: {directory} holds no checkpoint')
  state_dir = os.path.abspath(os.path.join(directory, str(step), 'state'))
  stored = ocp.PyTreeCheckpointer().metadata(state_dir)
  stored = getattr(stored, 'item_metadata', stored)['params']

  def check(path, shape):
    node = stored
    for key in path:
      node = node.get(key) if isinstance(node, dict) else None
    if node is None or tuple(node.shape) != tuple(shape):
      have = None if node is None else tuple(node.shape)
      raise InitError(f'{state_dir}: params/{"/".join(path)} has shape {have} there but '
                      f'{tuple(shape)} in this config')
    return node

  def read(path, abstract):
    node = check(path, abstract.shape)
    target = jax.ShapeDtypeStruct(node.shape, node.dtype, sharding=abstract.sharding)
    item = {'params': traverse_util.unflatten_dict({path: target})}
    restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
        item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item),
        partial_restore=True))
    return traverse_util.flatten_dict(restored['params'])[path].astype(abstract.dtype)

  return Source(f'run {os.path.abspath(workdir)} step {step}', dict(saved['model']), read, check)


def apply_model_fields(config, source: Source) -> None:
  """The model shape is the source's: its fields, and the defaults for any it does not name (not
  the preset's); how the step computes (remat, attention, loss chunks) stays this run's choice."""
  fields = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
  with config.unlocked():
    for key, value in {**fields, **source.model_fields}.items():
      if key not in (*COMPUTE_FIELDS, 'init_std'):
        config.model[key] = value


def _flat(tree: dict, whole=()) -> dict:
  """Path tuple -> leaf, with the subtrees at the paths in `whole` (quantized kernels' parts)
  kept as one leaf."""
  return traverse_util.flatten_dict(tree, is_leaf=lambda path, _: path in whole)


def _drop(tree: dict, paths: list[tuple]) -> dict:
  """A copy of `tree` without the leaves at `paths`."""
  paths = set(paths)
  return traverse_util.unflatten_dict({k: v for k, v in _flat(tree).items() if k not in paths})


@dataclasses.dataclass
class BaseLeaf:
  """One base weight as the source holds it (float) and where it goes in the train state."""
  path: tuple
  source: jax.ShapeDtypeStruct   # shape, dtype and sharding it is read into
  layer: object | None           # the Dense whose kernel this is (None: not a kernel)
  quantized: bool = False        # stored quantized (QLoRA's base): read in floats, then quantized


def base_leaves(s) -> list[BaseLeaf]:
  """The base weights a source provides (every parameter but the adapters, the fp8 amax
  histories and learned quantization step sizes), in the order they are loaded."""
  spec, layout = s.spec, s.layout
  where = 'frozen' if spec.adapters else 'params'
  float_model = nnx.eval_shape(lambda: spec.build(quantize=False))
  float_params = nnx.state(float_model, nnx.Param)
  float_shardings = shardings_for(logical_axes_tree(float_params), s.mesh, s.rules.params)
  shapes = nnx.to_pure_dict(float_params)
  kernels = {tuple(p.split('/')) + ('kernel',): d for p, d in dense_paths(float_model)}
  placed = _flat(layout.abstract[where], kernels)
  float_shardings = _flat(float_shardings)
  leaves = []
  for path, shape in _flat(shapes).items():
    if path[-1] in ('amax_history', 'step_size') or 'lora' in path:
      continue
    if isinstance(placed[path], dict):   # quantized parts: read in the compute dtype, then quantized
      abstract = jax.ShapeDtypeStruct(shape.shape, spec.policy.compute_dtype,
                                      sharding=float_shardings[path])
      leaves.append(BaseLeaf(path, abstract, kernels[path], quantized=True))
    else:
      leaves.append(BaseLeaf(path, placed[path], kernels.get(path)))
  return leaves


def check_source(s, source: Source) -> list[BaseLeaf]:
  """Every base weight's shape against the source, before anything is compiled or written."""
  leaves = base_leaves(s)
  for leaf in leaves:
    source.check(leaf.path, leaf.source.shape)
  return leaves


def initial_state(s, source: Source) -> dict:
  """The train state of a fresh run whose base weights come from `source` (s: run.Setup)."""
  spec, layout = s.spec, s.layout
  leaves = base_leaves(s)
  paths = [leaf.path for leaf in leaves]
  where = 'frozen' if spec.adapters else 'params'

  def rest():   # everything else from the random initialiser; the base is not returned, so XLA
    state = layout.init_fn()   # drops it
    state.pop('frozen', None)
    if where == 'params':   # the optimizer state is made from the loaded weights, below
      state['params'] = _drop(state['params'], paths)
      state.pop('opt_state')
    return state

  rest_shardings = dict(layout.shardings)
  rest_shardings.pop('frozen', None)
  if where == 'params':
    rest_shardings['params'] = _drop(rest_shardings['params'], paths)
    rest_shardings.pop('opt_state')
  state = jax.jit(rest, out_shardings=rest_shardings)()
  quantized = {leaf.path for leaf in leaves if leaf.quantized}
  # Every frozen leaf is a base weight, filled below; trainable ones are filled where they are base.
  values = _flat(layout.abstract['frozen'] if where == 'frozen' else state['params'], quantized)
  shardings = _flat(layout.shardings[where], quantized)
  for leaf in leaves:
    value = source.read(leaf.path, leaf.source)
    if leaf.quantized:   # QLoRA: quantized as soon as it is on the devices
      n_in = len(leaf.layer.in_features)
      stacked = value.ndim > n_in + len(leaf.layer.out_features)
      quantize = jax.jit(lambda k: quantize_parts(k, spec.base_format, n_in, stacked),
                         out_shardings=shardings[leaf.path])
      value = quantize(value)
    values[leaf.path] = value
    step_path = leaf.path[:-1] + ('step_size',)
    if leaf.layer is not None and step_path in values:   # LSQ: step sizes of the loaded kernel
      values[step_path] = _initial_step_sizes(leaf, value, shardings[step_path])
  state[where] = traverse_util.unflatten_dict(values)
  if where == 'params':   # the optimizer starts from the loaded weights (its master copy, if any)
    state['opt_state'] = layout.init_optimizer(state['params'])
  return state


def _initial_step_sizes(leaf: BaseLeaf, kernel: jax.Array, sharding) -> jax.Array:
  """LSQ's starting step sizes (quant/lsq.py) of a loaded kernel, per layer where it is stacked."""
  dense = leaf.layer
  n_in = len(dense.in_features)
  one = lambda k: lsq.initial_step_size(k, n_in, bits=4)
  if kernel.ndim > n_in + len(dense.out_features):
    one = jax.vmap(one)
  return jax.jit(one, out_shardings=sharding)(kernel)
