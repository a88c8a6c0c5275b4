"""The train state and where each of its arrays lives.

The state is a plain dict: `step`, `params` (the trainable weights, a pure dict mirroring the
model), `opt_state` (optax), `loss_scale`, and with LoRA `frozen`: the base weights, which get no
gradients and no optimizer state. A frozen matrix weight (optim/decay.py) needs no fp32 master
copy, so it is stored in the compute dtype (norm scales and biases keep the parameter dtype), and with `quant.weights` its
dense kernels are stored quantized (QLoRA). The state's shape and shardings are derived from
`jax.eval_shape` of the initialiser, so a model of any size can be described (and its train step
compiled) without allocating it; then `jax.jit(init, out_shardings=...)` creates the arrays already
in place.

Where the ZeRO axis does not divide a dimension, the stored array is padded (parallel/padding.py):
`abstract` has the stored shapes, `true` the model's. The optimizer works on the padded shapes of
its state (`update_shapes`: the parameters as its sharding pads them), so its state, and under
ZeRO-3 the parameters, are padded once, when created; only the model sees the true shapes (the
train step cuts the padding off inside the loss, and the padding's gradient is zero).
"""
import dataclasses
import functools
from typing import Any, Callable

import jax
import optax
from flax import nnx, traverse_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models import ModelConfig, Transformer
from models.dense import quantize_weights
from models.lora import LoraSpec
from optim.adam8bit import is_quantized_moment
from optim.decay import is_matrix_weight
from parallel.padding import Shapes, fit, padded_abstract, unpadded_shapes
from parallel.rules import LayoutRules, mesh_axes
from parallel.sharding import (check_divisible, fit_to_shapes, logical_axes_tree, replicated,
                               shard_ways, shardings_for)
from precision.loss_scale import init_loss_scale
from precision.policy import Policy
from quant.fp8 import AmaxHistory
from quant.weights import QuantizedWeight


@dataclasses.dataclass(frozen=True)
class ModelSpec:
  """Everything that builds the model: its shape, precision, seed, adapters and base storage."""
  config: ModelConfig
  policy: Policy
  seed: int
  adapters: LoraSpec | None = None   # LoRA: adapters trainable, everything else frozen
  base_format: str | None = None     # QLoRA: the frozen dense kernels stored in int8, int4 or nf4

  def build(self, quantize: bool = True) -> Transformer:
    model = Transformer(self.config, policy=self.policy, rngs=nnx.Rngs(params=self.seed),
                        adapters=self.adapters)
    if quantize and self.base_format:
      quantize_weights(model, self.base_format)
    return model

  @property
  def trainable(self):
    """The variables that get gradients: every parameter, or with LoRA the adapters (and the fp8
    amax histories, which the step updates)."""
    return nnx.Any(nnx.LoRAParam, AmaxHistory) if self.adapters else nnx.Param

  def split(self, model: nnx.Module):
    """(graphdef, trainable, frozen) with the weights as pure dicts: `frozen` holds every other
    variable, float matrices cast to the compute dtype and quantized kernels as they are stored."""
    graphdef, params, quantized, rest = nnx.split(model, self.trainable, QuantizedWeight, ...)
    frozen = jax.tree.map_with_path(self._frozen_dtype, nnx.to_pure_dict(rest))
    return graphdef, nnx.to_pure_dict(params), _merge_trees(frozen, nnx.to_pure_dict(quantized))

  def abstract(self) -> Transformer:
    """The built model as shapes (nothing allocated): a new module each call, from one trace of
    `build` per spec in this process (a QLoRA spec's quantizing build is ~0.5 s of tracing, and a
    run's set-up asks for it half a dozen times)."""
    return nnx.merge(*_abstract_split(self))

  def abstract_parts(self) -> tuple[dict, dict]:
    """`split`'s (trainable, frozen) as shapes: what `split(build())` makes, nothing allocated."""
    graphdef, state = _abstract_split(self)
    return jax.eval_shape(lambda state: self.split(nnx.merge(graphdef, state))[1:], state)

  def sizes(self) -> tuple[int, int]:
    """(values that train, bytes of the frozen base), from abstract shapes: nothing is allocated."""
    params, frozen = self.abstract_parts()
    return (sum(x.size for x in jax.tree.leaves(params)),
            sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen)))

  def _frozen_dtype(self, path, leaf):
    return leaf.astype(self.policy.compute_dtype) if is_matrix_weight(path) else leaf


@functools.lru_cache(maxsize=32)
def _abstract_split(spec: ModelSpec):
  """(graphdef, state) of `spec.build()` traced abstractly, its leaves shapes and dtypes only: a
  trace under a mesh gives them that mesh's (replicated) placement, which must not reach a caller
  under another mesh (the callers derive every placement from the logical axes)."""
  graphdef, state = nnx.split(nnx.eval_shape(spec.build))
  return graphdef, jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=x.weak_type), state)


def _merge_trees(a: dict, b: dict) -> dict:
  """The union of two trees of disjoint leaves."""
  flat = traverse_util.flatten_dict
  return traverse_util.unflatten_dict({**flat(a), **flat(b)})


@dataclasses.dataclass
class StateLayout:
  graphdef: Any            # the model's structure (nnx), merged with `params` to run it
  abstract: Any            # ShapeDtypeStruct tree of the train state as stored (padded), placed
  true: Any                # the same tree with the model's shapes (no padding), unplaced
  shardings: Any           # NamedSharding tree of the train state
  grad_shardings: Any      # where the gradients live (ZeRO-2 and up: sharded like the optimizer)
  update_shardings: Any    # where the optimizer's updates are formed: with its state (ZeRO-1 and up)
  update_shapes: Shapes    # the shapes they are formed in: the parameters', padded as the state is
  # Stacked weights stored whole but updated in shards (ZeRO-1/2): parameter path -> the sharding
  # of one layer of it, which the step gathers each layer's new values to (train/step.py).
  layer_writes: dict
  init: Callable[[], Any]  # jitted: creates the state already sharded
  init_fn: Callable[[], Any]   # the same, not jitted (train/init_from.py jits parts of it)
  init_optimizer: Callable[[Any], Any]   # jitted: a fresh optimizer state for given parameters
  # Each parameter stacked on a `layers` axis that no device splits (True/False, a tree like the
  # parameters), and for those, path -> the sharding one layer is stored in: the update of an
  # optimizer state in host memory streams them a layer at a time (train/offload.py).
  stacked: Any = None
  layer_shardings: dict = dataclasses.field(default_factory=dict)
  # An optimizer state in host memory is created one parameter's part at a time
  # (`optimizer_in_pieces`); None: `init_optimizer` makes it whole.
  optimizer_pieces: Callable[[Any], Any] | None = None

  def create_optimizer(self, params):
    """A fresh optimizer state for `params`, placed."""
    return (self.init_optimizer if self.optimizer_pieces is None else self.optimizer_pieces)(params)

  def create(self):
    """A fresh train state, placed: `init`, or where the optimizer's state lives in host memory,
    everything else first and that state from the parameters a piece at a time."""
    if self.optimizer_pieces is None:
      return self.init()
    return {**self.init_without_optimizer(), 'opt_state': self.optimizer_pieces(None)}

  def init_without_optimizer(self):
    """The fresh state but its optimizer's (XLA does not compute what is not returned)."""
    without = lambda tree: {k: v for k, v in tree.items() if k != 'opt_state'}
    return jax.jit(lambda: without(self.init_fn()), out_shardings=without(self.shardings))()

  @property
  def model_shapes(self) -> tuple[Shapes, Shapes]:
    """The model's shapes of the parameters and of the frozen base ({} without LoRA):
    `.fit(stored)` inside a program cuts their padding off."""
    return Shapes.of(self.true['params']), Shapes.of(self.true.get('frozen', {}))

  @property
  def unpadded(self) -> dict[str, list[int]]:
    """{path: true shape} of each padded array (checkpoints record it)."""
    return unpadded_shapes(self.true, self.abstract)


def block_axis(sharding) -> int:
  """The dimension an 8-bit moment is blocked from: its parameter's first sharded dimension."""
  return next((i for i, part in enumerate(sharding.spec) if shard_ways(sharding.mesh, part) > 1), 0)


def moment_block_axes(spec: ModelSpec, mesh: Mesh, rules: LayoutRules):
  """Per parameter, the dimension its 8-bit moments are blocked from (optim/adam8bit.py)."""
  axes = logical_axes_tree(nnx.split(spec.abstract(), spec.trainable, ...)[1])
  return jax.tree.map(block_axis, shardings_for(axes, mesh, rules.optimizer))


def _moment_sharding(leaf, sharding, mesh: Mesh):
  """A moment is placed like its parameter; an 8-bit moment ([blocks, block] codes and [blocks]
  scales, blocked from the parameter's first sharded dimension) splits its blocks over that
  dimension's mesh axes, where they divide."""
  if not is_quantized_moment(leaf):
    return sharding
  axes = mesh_axes(sharding.spec[block_axis(sharding)]) if sharding.spec else ()
  blocks = leaf['scale'].shape[0]
  spec = jax.sharding.PartitionSpec(axes if axes and blocks % shard_ways(mesh, axes) == 0 else None)
  return {'codes': jax.sharding.NamedSharding(mesh, spec),
          'scale': jax.sharding.NamedSharding(mesh, spec)}


def build_model(model_cfg: ModelConfig, policy: Policy, seed: int) -> Transformer:
  """The plain model (no adapters, float kernels)."""
  return ModelSpec(model_cfg, policy, seed).build()


def state_layout(spec: ModelSpec, tx: optax.GradientTransformation, mesh: Mesh,
                 rules: LayoutRules, host_optimizer: bool = False,
                 host_frozen: bool = False) -> StateLayout:
  """Raises ValueError naming a parameter dimension that a model-parallel mesh axis does not
  divide (the ZeRO axis's uneven splits are padded). `host_optimizer`, `host_frozen`: the
  optimizer's state, or the frozen base, lives in (pinned) host memory, sharded as it would be
  on the devices."""
  graphdef, abstract_params, abstract_rest = nnx.split(spec.abstract(), spec.trainable, ...)
  axes = logical_axes_tree(abstract_params)
  params_sharding = shardings_for(axes, mesh, rules.params)
  grad_sharding = shardings_for(axes, mesh, rules.grads)
  moment_sharding = shardings_for(axes, mesh, rules.optimizer)
  shapes = nnx.to_pure_dict(abstract_params)
  for what, sharding in (('parameter', params_sharding), ('optimizer state of', moment_sharding)):
    check_divisible(shapes, sharding, axes, what)

  update_shapes = Shapes.of(padded_abstract(shapes, moment_sharding))

  def state_of(params, frozen):
    state = {'step': jax.numpy.zeros((), jax.numpy.int32), 'params': params,
             'opt_state': tx.init(update_shapes.fit(params)), 'loss_scale': init_loss_scale()}
    if frozen:
      state['frozen'] = frozen
    return state

  init = lambda: state_of(*spec.split(spec.build())[1:])
  true = jax.eval_shape(state_of, *spec.abstract_parts())
  whole = replicated(mesh)
  # A multi_transform (fp8 histories beside Adam) leaves MaskedNode where a transform does not apply.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  opt_sharding = optax.tree_map_params(
      tx, lambda leaf, sharding: leaf if masked(leaf) else _moment_sharding(leaf, sharding, mesh),
      true['opt_state'], moment_sharding, transform_non_params=lambda _: whole,
      is_leaf=lambda x: is_quantized_moment(x) or masked(x))
  if host_optimizer:
    opt_sharding = in_host_memory(opt_sharding)
  shardings = {'step': whole, 'params': params_sharding, 'opt_state': opt_sharding,
               'loss_scale': jax.tree.map(lambda _: whole, true['loss_scale'])}
  if 'frozen' in true:
    shardings['frozen'] = frozen_shardings(abstract_rest, true['frozen'], mesh, rules)
    if host_frozen:
      shardings['frozen'] = in_host_memory(shardings['frozen'])
  abstract = padded_abstract(true, shardings)
  # The optimizer's state as the unpadded parameters make it: the true shapes of its padded parts.
  true = {**true, 'opt_state': jax.eval_shape(tx.init, shapes)}
  stored = Shapes.of(abstract)
  init_stored = lambda: stored.fit(init())
  init_optimizer = lambda params: tx.init(update_shapes.fit(params))
  return StateLayout(graphdef, abstract, true, shardings, grad_sharding, moment_sharding,
                     update_shapes, layer_writes(axes, params_sharding, moment_sharding),
                     jax.jit(init_stored, out_shardings=shardings), init_stored,
                     jax.jit(init_optimizer, out_shardings=opt_sharding),
                     *stacked_layers(axes, params_sharding),
                     optimizer_in_pieces(tx, update_shapes, opt_sharding, true['opt_state'],
                                         shapes, init_stored) if host_optimizer else None)


def optimizer_in_pieces(tx: optax.GradientTransformation, update_shapes: Shapes, shardings,
                        abstract_state, abstract_params, init_fn: Callable):
  """(params or None -> optimizer state) made one parameter's part at a time, each by its own
  jitted program whose outputs go to their (host memory) placement: XLA computes a program's
  outputs on the device before moving them, so made whole, the state would all be on the device
  at once (a 7B model's 81 GB). Each program makes one weight's master copy and moments (and the
  step counts), the other parameters' parts masked (optax.MaskedNode); from `params`, or with
  None from the initialiser `init_fn` as `init` makes them (its master copy from the weights
  before they are rounded to their stored dtype), whose other outputs XLA does not compute."""
  masked = lambda x: isinstance(x, optax.MaskedNode)
  flat_params, params_def = jax.tree.flatten(abstract_params)
  indices = params_def.unflatten(range(len(flat_params)))
  owners = jax.tree.leaves(optax.tree_map_params(
      tx, lambda _, i: i, abstract_state, indices, transform_non_params=lambda _: -1,
      is_leaf=masked), is_leaf=masked)
  state_def = jax.tree.structure(abstract_state, is_leaf=masked)

  def keep_only(tree, i):
    return state_def.unflatten([x if owner in (i, -1) or masked(x) else optax.MaskedNode()
                                for x, owner in zip(jax.tree.leaves(tree, is_leaf=masked), owners,
                                                    strict=True)])

  def from_params(i):
    def one(param):
      tree = params_def.unflatten([param if j == i else optax.MaskedNode()
                                   for j in range(len(flat_params))])
      return tx.init(params_def.unflatten([x if masked(x) else fit(x, update_shapes.leaves[j])
                                           for j, x in enumerate(params_def.flatten_up_to(tree))]))
    return one

  def programs(params=None):
    """(jitted program, its arguments) per parameter: from `params` (arrays or abstract), or
    with None from the initialiser."""
    for i in range(len(flat_params)):
      out = keep_only(shardings, i)
      if params is None:
        yield jax.jit(lambda i=i: keep_only(init_fn()['opt_state'], i), out_shardings=out), ()
      else:
        yield jax.jit(from_params(i), out_shardings=out), (jax.tree.leaves(params)[i],)

  def create(params=None):
    pieces = [program(*args) for program, args in programs(params)]
    return state_def.unflatten([jax.tree.leaves(pieces[max(owner, 0)], is_leaf=masked)[k]
                                for k, owner in enumerate(owners)])
  create.programs = programs
  return create


def in_host_memory(shardings):
  """The same placements in pinned host memory. Compile-only devices (`--target`) list no
  memories, and a sharding over them drops its memory kind without a word: a state placed so was
  compiled in device memory wherever no transfer in the step moved it (a frozen LoRA base, which
  the step hands back as it came), and the state's creation counted it there. Over them the
  placement is written over the mesh's abstract mesh, which keeps it. A program whose every
  placement is such takes its devices from the mesh in context (the step's: Setup.context; the
  creation's host-only pieces: init_from.py:_lowered_under_mesh); one with a device placement
  beside them takes them from it."""
  def in_host(sharding):
    placed = sharding.with_memory_kind('pinned_host')
    if placed.memory_kind is None:
      return NamedSharding(sharding.mesh.abstract_mesh, sharding.spec, memory_kind='pinned_host')
    return placed
  return jax.tree.map(in_host, shardings)


def stacked_layers(axes, params_sharding):
  """(a tree like the parameters: True where a weight is stacked on a `layers` axis that no
  device splits; path -> the sharding of one layer of each such weight)."""
  def one(names, sharding):
    spec = tuple(sharding.spec) + (None,) * (len(names) - len(sharding.spec))
    return names[:1] == ('layers',) and shard_ways(sharding.mesh, spec[0]) == 1
  stacked = jax.tree.map(one, axes, params_sharding, is_leaf=lambda x: isinstance(x, tuple))
  shardings = {path: NamedSharding(s.mesh, PartitionSpec(*tuple(s.spec)[1:]))
               for (path, s), (_, is_stacked) in zip(_keyed(params_sharding), _keyed(stacked))
               if is_stacked}
  return stacked, shardings


def layer_writes(axes, params_sharding, update_sharding) -> dict:
  """Parameter path -> the sharding of one layer, for each weight stacked on an unsplit `layers`
  axis whose stored sharding is not the one its update is formed in (ZeRO-1/2: stored whole,
  updated in shards). Gathered whole at once, all of such a weight's new values would exist a
  second time beside the weight (twice the stack at 70B: 140 GiB per device); gathered a layer at
  a time into the weight's own (donated) buffer, one layer does."""
  writes = {}
  flat_axes = {jax.tree_util.keystr(path): leaf for path, leaf in
               jax.tree_util.tree_flatten_with_path(axes, is_leaf=lambda x: isinstance(x, tuple))[0]}
  flat_updates = dict(_keyed(update_sharding))
  for path, stored in _keyed(params_sharding):
    spec = tuple(stored.spec) + (None,) * (len(flat_axes[path]) - len(stored.spec))
    if (flat_axes[path][:1] == ('layers',) and shard_ways(stored.mesh, spec[0]) == 1
        and stored.spec != flat_updates[path].spec):
      writes[path] = NamedSharding(stored.mesh, PartitionSpec(*spec[1:]))
  return writes


def _keyed(tree):
  return [(jax.tree_util.keystr(path), leaf)
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]]


def frozen_shardings(abstract_rest, frozen_shapes, mesh: Mesh, rules: LayoutRules):
  """The frozen base is placed like parameters (sharded over fsdp under ZeRO-3). A quantized part
  that a mesh axis does not divide (a small scale array) stays whole on that axis."""
  axes = logical_axes_tree(abstract_rest)
  shardings = shardings_for(axes, mesh, rules.params)
  quantized = nnx.to_pure_dict(nnx.filter_state(abstract_rest, QuantizedWeight))
  fitted = fit_to_shapes(quantized, _select(shardings, quantized))
  float_shapes = _exclude(frozen_shapes, quantized)
  float_shardings = _exclude(shardings, quantized)
  check_divisible(float_shapes, float_shardings, _exclude(axes, quantized), 'frozen weight')
  return _merge_trees(float_shardings, fitted)


def _select(tree: dict, like: dict) -> dict:
  """The leaves of `tree` at the paths of `like`'s leaves."""
  flat = traverse_util.flatten_dict(tree)
  return traverse_util.unflatten_dict({k: flat[k] for k in traverse_util.flatten_dict(like)})


def _exclude(tree: dict, like: dict) -> dict:
  """The leaves of `tree` at the paths `like` has no leaf at."""
  drop = traverse_util.flatten_dict(like)
  return traverse_util.unflatten_dict(
      {k: v for k, v in traverse_util.flatten_dict(tree).items() if k not in drop})
