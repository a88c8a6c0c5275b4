"""Where a fresh run's weights come from (`init_from`): random (''), a local Hugging Face Llama or
GPT-2 checkpoint ('hf:DIR'), or the latest checkpoint of an earlier run of ours ('run:DIR'). A
run's checkpoint is checked against the digests saved beside it as its tensors are read; one that
proves bad is reported and passed over for the next older one, as a resume does, and nothing of
the earlier run is moved or changed.

The model's shape is the source's (read from its config.json before anything is built). The base
weights are read and placed one tensor at a time, each straight into its sharding on the current
mesh, and a stacked kernel one layer at a time: each layer is read, cast or (QLoRA) quantized, and
written into its place in the stacked array, so neither the host nor the devices ever hold two
copies of the model, and a quantized base never exists whole in floats. What the source does not
hold (LoRA adapters, fp8 amax histories) comes from the random initialiser, jitted without the base
so that XLA drops the random base altogether. What depends on the weights is made from the loaded
ones: LSQ step sizes (2 mean|w| / sqrt(qmax) of each loaded kernel's output channel), and the
optimizer state (an fp32 master copy, where the policy keeps one, starts as the loaded weights in
their stored dtype).

A random start with a frozen base (LoRA, QLoRA) goes the same way (`fresh_state`), from a random
source: jitted whole, the initialiser lets XLA draw every layer of every kernel at once (its compiled
temporaries at the 7B preset: 57 GB for LoRA's 13.5 GB bf16 base, 130 GB for QLoRA's 3.7 GB NF4
one; at 20B 402 GB for 11 GB), which no GPU holds. The random source draws each kernel one layer at
a time from the initialiser's distribution (normal, the Dense's init_std) with its own keys (the
seed, the kernel's path and the layer), so a random base is the same on every mesh but not the
values the whole initialiser would have drawn; the base's other weights (norm scales, embedding)
are the initialiser's own.
"""
import dataclasses
import functools
import json
import os
import zlib
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx, traverse_util

from memory.compiled import compiled_memory_spaces
from models import ModelConfig
from models.config import COMPUTE_FIELDS
from models.lora import dense_paths
from parallel.padding import fit
from parallel.sharding import (device_bytes, fit_to_shapes, logical_axes_tree,
                               shardings_for)
from quant import lsq
from quant.weights import quantize_parts
from train.checkpoint import (Checkpointer, DigestMismatch, agree_outcomes, agreed,
                              meeting_orbax_barrier, refusal)
from train.digest import host_digest
from train.setup import Setup

KINDS = ('hf', 'run')


class InitError(ValueError):
  pass


class SourceDamaged(InitError):
  """A checkpoint of the init_from run proved bad while its tensors were read; `older()` opens
  the run's next older checkpoint (None: it has none)."""

  def __init__(self, path: str, why: str, older):
    super().__init__(f'{path} does not restore ({why})')
    self.path, self.why, self.older = path, why, older


@dataclasses.dataclass
class Source:
  """Base weights by parameter path. `reader(path, abstract)` returns a function that reads that
  weight placed as `abstract` (a ShapeDtypeStruct with a sharding) says: called with no argument,
  the whole array; with a layer index, that layer of a stacked one, placed as `layer_of(abstract)`.
  Whatever it holds to read the layers (a host copy of the tensor) is freed with it.
  `check(path, shape)` raises InitError naming the tensor and both shapes where they differ,
  reading no tensor data. `kernels_only`: the source holds the dense kernels only (a random base);
  the other base weights are the initialiser's."""
  description: str
  model_fields: dict
  reader: Callable[[tuple, jax.ShapeDtypeStruct], Callable[..., jax.Array]]
  check: Callable[[tuple, tuple], None]
  kernels_only: bool = False


def layer_of(abstract: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
  """One layer of a stacked array: its shape and dtype without the leading axis, sharded like it
  on the rest."""
  sharding = abstract.sharding
  spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
  return jax.ShapeDtypeStruct(abstract.shape[1:], abstract.dtype,
                              sharding=jax.sharding.NamedSharding(sharding.mesh, spec))


def _from_host(host: np.ndarray, abstract: jax.ShapeDtypeStruct, layer: int | None = None):
  """A host array, or one layer of it, placed as `abstract` (or its layer) says; each device
  copies only its own shard."""
  if layer is not None:
    host, abstract = host[layer], layer_of(abstract)
  return jax.make_array_from_callback(abstract.shape, abstract.sharding, lambda i: host[i])


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

  def reader(path, abstract):
    try:
      host = checkpoint.read(path, abstract.shape, abstract.dtype)
    except ConvertError as e:
      raise InitError(str(e)) from None
    return functools.partial(_from_host, host, abstract)

  def check(path, shape):
    try:
      checkpoint.check(path, shape)
    except ConvertError as e:
      raise InitError(str(e)) from None

  return Source(f'{checkpoint.arch} checkpoint {os.path.abspath(directory)}', fields, reader,
                check)


def _run_source(workdir: str, steps: list[int] | None = None) -> Source:
  """The earlier run's newest checkpoint of `steps` (default: all it has). Each tensor read is
  checked against the digests saved beside the checkpoint; one that proves bad, here or as its
  tensors are read (SourceDamaged), gives way to the next older one, as a resume's does."""
  config_path = os.path.join(workdir, 'config.json')
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isfile(config_path) or not os.path.isdir(directory):
    raise InitError(f'init_from=run:{workdir}: no config.json and checkpoints/ there; point it at '
                    f'the workdir of an earlier training run')
  with open(config_path) as f:
    saved = json.load(f)
  if saved.get('lora', {}).get('rank', 0):
    raise InitError(f'init_from=run:{workdir} is a LoRA run (lora.rank={saved["lora"]["rank"]}); '
                    f'export it merged (python -m cli.export_hf) and use init_from=hf:DIR')
  checkpoints = Checkpointer(directory, keep=1 << 30)
  steps = agreed('init_from/steps', checkpoints.steps) if steps is None else steps
  if not steps:
    checkpoints.close()
    raise InitError(f'init_from=run:{workdir}: {directory} holds no checkpoint')
  step, path = steps[0], checkpoints.path(steps[0])
  older = (lambda: _run_source(workdir, steps[1:])) if steps[1:] else None
  state_dir = os.path.abspath(os.path.join(path, 'state'))
  unpadded = digests = stored = error = None
  try:
    # The true shapes of what the source's mesh stored padded (parallel/padding.py).
    unpadded = (checkpoints.read_meta(step) or {}).get('unpadded', {})
    digests = checkpoints.saved_digests(step)
    stored = ocp.PyTreeCheckpointer().metadata(state_dir)
    stored = getattr(stored, 'item_metadata', stored)['params']
  except Exception as e:
    error = e
  finally:
    checkpoints.close()
  outcome, why = agree_outcomes(f'init_from/{step}', error)   # every process the same
  if outcome != 'ok':
    _passed_over(path, outcome, why, older)
    return older()

  def true_shape(path, node) -> tuple:
    return tuple(unpadded.get('/'.join(('params',) + tuple(path)), node.shape))

  def check(path, shape):
    node = stored
    for key in path:
      node = node.get(key) if isinstance(node, dict) else None
    if node is None or true_shape(path, node) != tuple(shape):
      have = None if node is None else true_shape(path, node)
      raise InitError(f'{state_dir}: params/{"/".join(path)} has shape {have} there but '
                      f'{tuple(shape)} in this config')
    return node

  def read_verified(path, abstract) -> np.ndarray:
    """The tensor restored to the host in the dtype it was saved in, cut to its true shape, and
    checked against its saved digest."""
    node = check(path, abstract.shape)
    item = {'params': traverse_util.unflatten_dict({path: jax.ShapeDtypeStruct(node.shape,
                                                                                node.dtype)})}
    restore_args = {'params': traverse_util.unflatten_dict(
        {path: ocp.RestoreArgs(restore_type=np.ndarray)})}
    with meeting_orbax_barrier(prefix=None):   # a PyTreeCheckpointer's barrier names have none
      restored = ocp.PyTreeCheckpointer().restore(state_dir, args=ocp.args.PyTreeRestore(
          item=item, restore_args=restore_args, partial_restore=True))
    host = np.asarray(traverse_util.flatten_dict(restored['params'])[path])
    host = host[tuple(slice(0, n) for n in abstract.shape)]   # no padding
    name = '/'.join(('params', *path))
    if digests and name in digests['arrays'] and host_digest(host) != digests['arrays'][name]:
      raise DigestMismatch(f'{name} differs from what was saved (its digest does not match)')
    return host

  def reader(tensor, abstract):
    # Every process reads and checks the tensor, and all agree on the outcome before any places it
    # (a collective): one process's bad read passes over the checkpoint for all.
    host = error = None
    try:
      host = read_verified(tensor, abstract)
    except InitError:
      raise
    except Exception as e:
      error = e
    outcome, why = agree_outcomes(f'init_from/{step}/{"/".join(tensor)}', error)
    if outcome in ('temporary', 'failed'):
      raise refusal(path, why, outcome == 'temporary')
    if outcome == 'broken':
      raise SourceDamaged(path, why, older)
    # Cast on the host, so that the devices get one layer at a time, never the whole stacked
    # tensor in floats.
    return functools.partial(_from_host, host.astype(abstract.dtype), abstract)

  return Source(f'run {os.path.abspath(workdir)} step {step}', dict(saved['model']), reader,
                check)


def _passed_over(path: str, outcome: str, why: str, older) -> None:
  """Report a checkpoint of the init_from run that proved bad, before its older one is tried;
  raise if there is none, or if the `outcome` of reading it was no evidence against it."""
  if outcome != 'broken':
    raise refusal(path, why, outcome == 'temporary')
  if older is None:
    raise InitError(f'{path} does not restore ({why}), and the run has no older checkpoint; '
                    f'nothing was changed: restore its files, or start from another')
  if jax.process_index() == 0:
    print(f'checkpoint  {path} does not restore ({why}); trying an older one')


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


@dataclasses.dataclass
class BaseLeaf:
  """One base weight as the source holds it (float) and where it goes in the train state."""
  path: tuple
  source: jax.ShapeDtypeStruct   # shape, dtype and sharding it is read into
  layer: object | None           # the Dense whose kernel this is (None: not a kernel)
  quantized: bool = False        # stored quantized (QLoRA's base): read in floats, then quantized


def base_leaves(s: Setup) -> list[BaseLeaf]:
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
                                      sharding=fit_to_shapes(shape, float_shardings[path]))
      leaves.append(BaseLeaf(path, abstract, kernels[path], quantized=True))
    else:   # read at its true shape (stored padded where fsdp splits it unevenly: whole there)
      stored = placed[path]
      abstract = jax.ShapeDtypeStruct(shape.shape, stored.dtype,
                                      sharding=fit_to_shapes(shape, stored.sharding))
      leaves.append(BaseLeaf(path, abstract, kernels.get(path)))
  return leaves


def check_source(s: Setup, source: Source) -> list[BaseLeaf]:
  """Every base weight's shape against the source, before anything is compiled or written."""
  leaves = base_leaves(s)
  for leaf in leaves:
    source.check(leaf.path, leaf.source.shape)
  return leaves


def initial_state(s: Setup, source: Source) -> dict:
  """The train state of a fresh run whose base weights come from `source`."""
  spec, layout = s.spec, s.layout
  leaves = [leaf for leaf in base_leaves(s) if leaf.layer is not None or not source.kernels_only]
  quantized = {leaf.path for leaf in leaves if leaf.quantized}
  where = 'frozen' if spec.adapters else 'params'
  state = rest_initialiser(s, leaves)()
  values = _flat(state[where], quantized)
  shardings = _flat(layout.shardings[where], quantized)
  stored = _flat(layout.abstract[where], quantized)
  for leaf in leaves:
    store = storer(leaf, stored[leaf.path], shardings[leaf.path], spec.base_format)
    read = source.reader(leaf.path, leaf.source)
    if _stacked(leaf):   # one layer at a time, written into the stacked array in place
      value = jax.tree.map(lambda a, where: _zeros(a.shape, jnp.dtype(a.dtype), where)(),
                           stored[leaf.path], shardings[leaf.path])
      for index in range(leaf.source.shape[0]):
        value = store(value, read(index), np.int32(index))
    else:
      value = store(read())
    del read   # what the source held for this weight
    values[leaf.path] = value
    step_path = leaf.path[:-1] + ('step_size',)
    if leaf.layer is not None and step_path in values:   # LSQ: step sizes of the loaded kernel
      values[step_path] = _initial_step_sizes(leaf, value, stored[step_path])
  state[where] = traverse_util.unflatten_dict(values)
  if where == 'params':   # the optimizer starts from the loaded weights (its master copy, if any)
    state['opt_state'] = layout.create_optimizer(state['params'])
  return state


def rest_initialiser(s: Setup, leaves: list[BaseLeaf]):
  """The random initialiser, jitted without the base weights `leaves` (and, where they are
  trainable, without the optimizer state, which is made from them): XLA drops what is not
  returned, so the base is never drawn whole."""
  where = 'frozen' if s.spec.adapters else 'params'
  paths = {leaf.path for leaf in leaves}
  quantized = {leaf.path for leaf in leaves if leaf.quantized}

  def without_base(tree):
    tree = dict(tree)
    tree[where] = traverse_util.unflatten_dict(
        {k: v for k, v in _flat(tree[where], quantized).items() if k not in paths})
    if where == 'params':
      tree.pop('opt_state')
    return tree

  return jax.jit(lambda: without_base(s.layout.init_fn()),
                 out_shardings=without_base(s.layout.shardings))


def _stacked(leaf: BaseLeaf) -> bool:
  dense = leaf.layer
  return dense is not None and len(leaf.source.shape) > len(dense.in_features) + len(
      dense.out_features)


def storer(leaf: BaseLeaf, stored, sharding, base_format: str | None):
  """Jitted: a base weight as read (floats) to what the state stores (`stored`: its abstract
  value, quantized parts for QLoRA's kernels). For a stacked kernel it takes (the stacked array,
  one layer, its index) and writes the layer in place (the array is donated), so only one layer is
  ever in floats beside what is already stored; otherwise it takes the whole weight."""
  n_in = len(leaf.layer.in_features) if leaf.layer is not None else 0
  if isinstance(sharding, dict):   # quantized parts: a hashable key for the cache
    sharding = tuple(sorted(sharding.items()))
  shape = None if leaf.quantized else tuple(stored.shape)
  return _storer(base_format if leaf.quantized else None, n_in,
                 None if leaf.quantized else jnp.dtype(stored.dtype), _stacked(leaf), sharding,
                 shape)


@functools.cache
def _storer(base_format: str | None, n_in: int, dtype, stacked: bool, sharding, shape):
  """storer's jitted function, one per kind of weight (the same layer shapes and placement
  recompile nothing, in one run or the next). `shape`: the stored one, padded where the mesh pads
  it (parallel/padding.py); None for quantized parts, which are stored as read."""
  sharding = dict(sharding) if isinstance(sharding, tuple) else sharding
  if base_format:   # QLoRA: quantized as soon as it is on the devices
    store = lambda w: quantize_parts(w, base_format, n_in, stacked=False)
  elif stacked:
    store = lambda w: fit(w.astype(dtype), shape[1:])
  else:
    store = lambda w: fit(w.astype(dtype), shape)
  if not stacked:
    return jax.jit(store, out_shardings=sharding)

  def write(whole, w, index):
    return jax.tree.map(lambda x, y: jax.lax.dynamic_update_index_in_dim(
        x, _in_memory_of(x, y), index, 0), whole, store(w))

  return jax.jit(write, out_shardings=sharding, donate_argnums=0)


def _in_memory_of(like: jax.Array, x: jax.Array) -> jax.Array:
  """`x` in the memory `like` lives in (host memory for a base under parallel.offload_frozen)."""
  space = jax.typeof(like).memory_space
  return x if jax.typeof(x).memory_space == space else jax.device_put(x, space)


@functools.cache
def _zeros(shape: tuple, dtype, sharding):
  """Jitted: zeros placed by `sharding` (on every process of a multi-host mesh alike)."""
  return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.cache
def _normal(shape: tuple, dtype, sharding, std: float):
  """Jitted: normal values with standard deviation `std` drawn in fp32, as `dtype`, from the key
  of (seed, stream, layer) (numpy integers: every process passes the same, nothing is committed
  to a local device first)."""
  def draw(seed, stream, layer):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(seed), stream), layer)
    return (jax.random.normal(key, shape, jnp.float32) * std).astype(dtype)

  return jax.jit(draw, out_shardings=sharding)


def random_source(s: Setup) -> Source:
  """A random frozen base (LoRA, QLoRA): each dense kernel drawn one layer at a time, normal with
  its Dense's init_std in fp32 (as the initialiser draws it) from keys of the run's seed, the
  kernel's path and the layer."""
  stds = {leaf.path: leaf.layer.init_std for leaf in base_leaves(s) if leaf.layer is not None}
  seed = np.uint32(s.spec.seed)

  def reader(path, abstract):
    stream = np.uint32(zlib.crc32('/'.join(path).encode()))

    def read(layer=None):
      placed = abstract if layer is None else layer_of(abstract)
      draw = _normal(tuple(placed.shape), jnp.dtype(placed.dtype), placed.sharding,
                     float(stds[path]))
      return draw(seed, stream, np.uint32(layer or 0))

    return read

  def check(path, shape):
    if path not in stds:
      raise InitError(f'{"/".join(path)} is not a dense kernel; a random base draws kernels only')

  return Source(f'random (seed {seed})', {}, reader, check, kernels_only=True)


def fresh_state(s: Setup, source: Source | None = None) -> dict:
  """A fresh run's train state: from `source` (init_from), else random; a random frozen base
  (LoRA, QLoRA) is drawn a layer at a time (random_source), never whole."""
  if source is None and 'frozen' not in s.layout.abstract:
    return s.layout.create()
  return state_from(s, source or random_source(s))[0]


def state_from(s: Setup, source: Source) -> tuple[dict, Source]:
  """(the state made from `source`, the source it came from): a run's checkpoint that proves bad
  as it is read gives way to its next older one."""
  while True:
    try:
      return initial_state(s, source), source
    except SourceDamaged as e:
      _passed_over(e.path, 'broken', e.why, e.older)
      source = e.older()


def _initial_step_sizes(leaf: BaseLeaf, kernel: jax.Array, stored) -> jax.Array:
  """LSQ's starting step sizes (quant/lsq.py) of a loaded kernel, per layer where it is stacked,
  from the kernel's true values (its padding cut off) and stored as `stored` says."""
  dense = leaf.layer
  n_in = len(dense.in_features)
  one = lambda k: lsq.initial_step_size(k, n_in, bits=4)
  if kernel.ndim > n_in + len(dense.out_features):
    one = jax.vmap(one)
  return jax.jit(lambda k: fit(one(fit(k, leaf.source.shape)), stored.shape),
                 out_shardings=stored.sharding)(kernel)


def _lowered_under_mesh(s: Setup, program, args):
  """`program` lowered on `args` under the run's mesh, as the step is: on compile-only devices a
  piece whose every placement is in host memory names no devices of its own (they are written
  over the abstract mesh: train/state.py:in_host_memory)."""
  with jax.set_mesh(s.mesh):
    return program.lower(*args)


def _peak(compiled) -> int:
  """A compiled creation piece's own peak on one device: what it returns to device memory and
  its temporaries."""
  device, _ = compiled_memory_spaces(compiled)
  return device['outputs'] + device['temp']


def creation_bytes(s: Setup, source: Source | None = None) -> dict:
  """Per-device bytes while a fresh run creates its state, from compiled memory analyses (nothing
  is allocated), as `fresh_state` creates it: `peak`, the largest of its pieces, and `state`,
  what is left at the end. Jitted whole (no base to load): the initialiser's outputs and
  temporaries. Loaded or drawn weight by weight: the first piece (everything but the base,
  `first_piece`), then, as a bound, the whole state with one weight (or one layer of a stacked
  one) being stored (`largest_store`: its float values and the store's temporaries), and where the
  loaded weights train, the optimizer state made from them."""
  state = device_bytes(s.layout.abstract)
  pieces = s.layout.optimizer_pieces
  if source is None and 'frozen' not in s.layout.abstract and pieces is None:
    peak = _peak(s.layout.init.lower().compile())
    return {'peak': peak, 'state': state, 'first_piece': peak, 'largest_store': 0}
  if source is None and 'frozen' not in s.layout.abstract:
    # The optimizer state in host memory, made a weight at a time after the rest (state.py:create).
    without = lambda tree: {k: v for k, v in tree.items() if k != 'opt_state'}
    rest = jax.jit(lambda: without(s.layout.init_fn()), out_shardings=without(s.layout.shardings))
    first_piece = _peak(rest.lower().compile())
    largest = max(_peak(_lowered_under_mesh(s, program, args).compile())
                  for program, args in pieces.programs())
    return {'peak': max(first_piece, state + largest), 'state': state,
            'first_piece': first_piece, 'largest_store': largest}
  spec, layout = s.spec, s.layout
  kernels_only = source is None or source.kernels_only
  leaves = [leaf for leaf in base_leaves(s) if leaf.layer is not None or not kernels_only]
  quantized = {leaf.path for leaf in leaves if leaf.quantized}
  where = 'frozen' if spec.adapters else 'params'
  stored = _flat(layout.abstract[where], quantized)
  shardings = _flat(layout.shardings[where], quantized)
  first_piece = _peak(rest_initialiser(s, leaves).lower().compile())
  largest_store = 0
  for leaf in leaves:
    store = storer(leaf, stored[leaf.path], shardings[leaf.path], spec.base_format)
    value = layer_of(leaf.source) if _stacked(leaf) else leaf.source
    args = (stored[leaf.path], value, np.int32(0)) if _stacked(leaf) else (value,)
    temp = _lowered_under_mesh(s, store, args).compile().memory_analysis().temp_size_in_bytes
    largest_store = max(largest_store, int(temp) + device_bytes(value))
  peak = max(first_piece, state + largest_store)
  if where == 'params':
    optimizer = layout.init_optimizer.lower(layout.abstract['params']).compile().memory_analysis()
    peak = max(peak, state + int(optimizer.temp_size_in_bytes))
  return {'peak': peak, 'state': state, 'first_piece': first_piece,
          'largest_store': largest_store}
