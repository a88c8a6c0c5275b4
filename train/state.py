"""The train state and where each of its arrays lives.

The state is a plain dict: `step`, `params` (a pure dict mirroring the model), `opt_state` (optax)
and `loss_scale`. Its shape and shardings are derived from `jax.eval_shape` of the initialiser, so
a model of any size can be described (and its train step compiled) without allocating it; then
`jax.jit(init, out_shardings=...)` creates the arrays already in place.
"""
import dataclasses
import math
from typing import Any, Callable

import jax
import optax
from flax import nnx
from jax.sharding import Mesh

from models import ModelConfig, Transformer
from parallel.rules import LayoutRules
from parallel.sharding import check_divisible, logical_axes_tree, replicated, shardings_for
from quant.adam8bit import is_quantized_moment
from quant.loss_scale import init_loss_scale
from quant.precision import Policy


@dataclasses.dataclass
class StateLayout:
  graphdef: Any            # the model's structure (nnx), merged with `params` to run it
  abstract: Any            # ShapeDtypeStruct tree of the train state, each with its sharding
  shardings: Any           # NamedSharding tree of the train state
  grad_shardings: Any      # where the gradients live (ZeRO-2 and up: sharded like the optimizer)
  init: Callable[[], Any]  # jitted: creates the state already sharded


def _mesh_axes(part) -> tuple[str, ...]:
  return (part,) if isinstance(part, str) else tuple(part or ())


def block_axis(sharding) -> int:
  """The dimension an 8-bit moment is blocked from: its parameter's first sharded dimension."""
  mesh = sharding.mesh
  return next((i for i, part in enumerate(sharding.spec)
               if math.prod(mesh.shape[a] for a in _mesh_axes(part)) > 1), 0)


def moment_block_axes(model_cfg: ModelConfig, policy: Policy, mesh: Mesh, rules: LayoutRules,
                      seed: int):
  """Per parameter, the dimension its 8-bit moments are blocked from (quant/adam8bit.py)."""
  abstract_model = nnx.eval_shape(lambda: build_model(model_cfg, policy, seed))
  axes = logical_axes_tree(nnx.split(abstract_model, nnx.Param)[1])
  return jax.tree.map(block_axis, shardings_for(axes, mesh, rules.optimizer))


def _moment_sharding(leaf, sharding, mesh: Mesh):
  """A moment is placed like its parameter; an 8-bit moment ([blocks, block] codes and [blocks]
  scales, blocked from the parameter's first sharded dimension) splits its blocks over that
  dimension's mesh axes, where they divide."""
  if not is_quantized_moment(leaf):
    return sharding
  axes = _mesh_axes(sharding.spec[block_axis(sharding)]) if sharding.spec else ()
  ways = math.prod(mesh.shape[a] for a in axes)
  blocks = leaf['scale'].shape[0]
  spec = jax.sharding.PartitionSpec(axes if axes and blocks % ways == 0 else None)
  return {'codes': jax.sharding.NamedSharding(mesh, spec),
          'scale': jax.sharding.NamedSharding(mesh, spec)}


def build_model(model_cfg: ModelConfig, policy: Policy, seed: int) -> Transformer:
  return Transformer(model_cfg, policy=policy, rngs=nnx.Rngs(params=seed))


def state_layout(model_cfg: ModelConfig, policy: Policy, tx: optax.GradientTransformation,
                 mesh: Mesh, rules: LayoutRules, seed: int) -> StateLayout:
  """Raises ValueError naming a parameter dimension that the mesh does not divide."""
  abstract_model = nnx.eval_shape(lambda: build_model(model_cfg, policy, seed))
  graphdef, abstract_params = nnx.split(abstract_model, nnx.Param)
  axes = logical_axes_tree(abstract_params)
  params_sharding = shardings_for(axes, mesh, rules.params)
  grad_sharding = shardings_for(axes, mesh, rules.grads)
  moment_sharding = shardings_for(axes, mesh, rules.optimizer)
  shapes = nnx.to_pure_dict(abstract_params)
  for what, sharding in (('parameter', params_sharding), ('optimizer state of', moment_sharding)):
    check_divisible(shapes, sharding, axes, what)

  def init():
    graphdef_, params = nnx.split(build_model(model_cfg, policy, seed), nnx.Param)
    params = nnx.to_pure_dict(params)
    return {'step': jax.numpy.zeros((), jax.numpy.int32), 'params': params,
            'opt_state': tx.init(params), 'loss_scale': init_loss_scale()}

  abstract = jax.eval_shape(init)
  whole = replicated(mesh)
  # A multi_transform (fp8 histories beside Adam) leaves MaskedNode where a transform does not apply.
  masked = lambda x: isinstance(x, optax.MaskedNode)
  opt_sharding = optax.tree_map_params(
      tx, lambda leaf, sharding: leaf if masked(leaf) else _moment_sharding(leaf, sharding, mesh),
      abstract['opt_state'], moment_sharding, transform_non_params=lambda _: whole,
      is_leaf=lambda x: is_quantized_moment(x) or masked(x))
  shardings = {'step': whole, 'params': params_sharding, 'opt_state': opt_sharding,
               'loss_scale': jax.tree.map(lambda _: whole, abstract['loss_scale'])}
  abstract = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                          abstract, shardings)
  return StateLayout(graphdef, abstract, shardings, grad_sharding,
                     jax.jit(init, out_shardings=shardings))
