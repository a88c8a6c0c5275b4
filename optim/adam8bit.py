"""Adam with 8-bit moments (block-wise dynamic quantization), as an optax GradientTransformation.

optax has no 8-bit optimizer state; this is the bitsandbytes scheme written for JAX: each step the
two moments are dequantized to fp32, updated exactly as in Adam, and quantized back (one byte per
value plus one fp32 scale per block). Tensors with fewer than `min_quantized_size` elements (norm
scales, biases) keep fp32 moments: they cost little and are the most sensitive. The first moment
uses the signed code book, the second (never negative) the unsigned one, which spends all 256
values on magnitudes.

`adamw_8bit` is AdamW with clipping: the whole update chain (clip by the global norm, Adam, weight
decay, learning rate) runs inside each slice's loop iteration, writing the final update over that
slice's gradient, so no full-size fp32 buffer of any step of the chain exists after the loop (as
optax.chain(clip, scale_by_adam_8bit, add_decayed_weights, scale_by_learning_rate) would leave).
Its state is that chain's, so checkpoints of either restore into the other.

A moment is cut into blocks after moving its parameter's sharded dimension to the front
(`block_axes`): that dimension is then the outermost of the flattening, so each device's slice of
the parameter is one contiguous run of whole blocks, and no step has to reshard the gradients into
blocks and back. (A parameter split along two dimensions, e.g. fsdp x tensor, is not contiguous
either way; its blocks are resharded.)
"""
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from quant.blockwise import (dequantize_blocks, from_blocks, quantize_blocks, to_blocks,
                             zero_blocks)

BLOCK_SIZES = (256, 2048)
# A quantized moment is updated in this many slices (one at a time, in a loop), so that its fp32
# working copies never exist for the whole tensor at once.
UPDATE_SLICES = 16


def is_quantized_moment(leaf) -> bool:
  """A moment stored in 8 bits: {'codes': uint8 [blocks, block], 'scale': fp32 [blocks]}."""
  return isinstance(leaf, dict) and set(leaf) == {'codes', 'scale'}


class ScaleByAdam8bitState(NamedTuple):
  count: jax.Array
  mu: optax.Updates   # per leaf: fp32 array, or {'codes': uint8, 'scale': fp32} when quantized
  nu: optax.Updates


def _check_block_size(block_size: int) -> None:
  if block_size not in BLOCK_SIZES:
    raise ValueError(f'quant.adam_block_size={block_size}; allowed: {", ".join(map(str, BLOCK_SIZES))}')


def _init(block_size: int, min_quantized_size: int):
  def zeros(p, signed):
    if p.size >= min_quantized_size:
      return zero_blocks(p.shape, block_size, signed)
    return jnp.zeros(p.shape, jnp.float32)

  def init_fn(params):
    return ScaleByAdam8bitState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: zeros(p, True), params),
        nu=jax.tree.map(lambda p: zeros(p, False), params))
  return init_fn


def _adam_updates(updates, state: ScaleByAdam8bitState, params, *, b1, b2, eps, block_size,
                  min_quantized_size, block_axes, finish, grad_scale=1.0):
  """(update per leaf, new state). Gradients are multiplied by `grad_scale` (clipping) as each
  slice is read. `finish(step, param, leaf_index) -> update` turns each Adam
  step (fp32, a slice at a time for quantized moments) into the update, given the same slice of
  the parameter (None when `params` is None)."""
  count = optax.safe_increment(state.count)
  correction1 = 1 - b1 ** count.astype(jnp.float32)
  correction2 = 1 - b2 ** count.astype(jnp.float32)

  def adam(g, mu, nu):
    g = g.astype(jnp.float32) * grad_scale
    mu = b1 * mu + (1 - b1) * g
    nu = b2 * nu + (1 - b2) * jnp.square(g)
    return (mu / correction1) / (jnp.sqrt(nu / correction2) + eps), mu, nu

  def one(index, g, mu_stored, nu_stored, axis, param):
    if g.size < min_quantized_size:
      step, mu, nu = adam(g, mu_stored, nu_stored)
      return finish(step, param, index).astype(g.dtype), mu, nu
    # A local transpose: the sharded dimension becomes outermost.
    blocked = lambda x: to_blocks(jnp.moveaxis(x, axis, 0), block_size)
    blocks = blocked(g)
    slices = math.gcd(blocks.shape[0], UPDATE_SLICES)

    def interleaved(x):   # [blocks, ...] -> [blocks / slices, slices, ...], no copy
      return x.reshape(x.shape[0] // slices, slices, *x.shape[1:])

    param_slices = None if param is None else interleaved(blocked(param))

    # Slice i is rows i, i + slices, ...: every data-parallel shard keeps its own rows, and the
    # buffers are read and written in place through the loop. Each slice's update overwrites that
    # slice's gradient, which is not read again: no separate full-size buffer.
    def update_slice(i, carry):
      grads_then_updates, mu_q, nu_q = carry
      take = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
      put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, axis=1)
      step, mu, nu = adam(take(grads_then_updates),
                          dequantize_blocks(jax.tree.map(take, mu_q), True),
                          dequantize_blocks(jax.tree.map(take, nu_q), False))
      update = finish(step, None if param_slices is None else take(param_slices), index)
      return (put(grads_then_updates, update.astype(grads_then_updates.dtype)),
              jax.tree.map(put, mu_q, quantize_blocks(mu, True)),
              jax.tree.map(put, nu_q, quantize_blocks(nu, False)))

    update, mu_q, nu_q = jax.lax.fori_loop(
        0, slices, update_slice,
        (interleaved(blocks), jax.tree.map(interleaved, mu_stored),
         jax.tree.map(interleaved, nu_stored)))
    update = update.reshape(blocks.shape)
    mu_q, nu_q = (jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), q) for q in (mu_q, nu_q))
    return jnp.moveaxis(from_blocks(update, jnp.moveaxis(g, axis, 0).shape), 0, axis), mu_q, nu_q

  flat_updates, treedef = jax.tree.flatten(updates)
  flat_mu = jax.tree.leaves(state.mu, is_leaf=is_quantized_moment)
  flat_nu = jax.tree.leaves(state.nu, is_leaf=is_quantized_moment)
  flat_axes = ([0] * len(flat_updates) if block_axes is None else
               treedef.flatten_up_to(block_axes))
  flat_params = [None] * len(flat_updates) if params is None else treedef.flatten_up_to(params)
  results = [one(i, *leaf) for i, leaf in
             enumerate(zip(flat_updates, flat_mu, flat_nu, flat_axes, flat_params))]
  steps, mus, nus = zip(*results) if results else ((), (), ())
  return (jax.tree.unflatten(treedef, steps),
          ScaleByAdam8bitState(count, jax.tree.unflatten(treedef, mus),
                               jax.tree.unflatten(treedef, nus)))


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 2048, min_quantized_size: int = 4096,
                       block_axes=None) -> optax.GradientTransformation:
  """Adam's step alone (optax.scale_by_adam with 8-bit moments). `block_axes`: a tree like the
  parameters of the dimension each moment is blocked from (its parameter's sharded dimension);
  None blocks every tensor from dimension 0."""
  _check_block_size(block_size)

  def update_fn(updates, state, params=None):
    del params
    return _adam_updates(updates, state, None, b1=b1, b2=b2, eps=eps, block_size=block_size,
                         min_quantized_size=min_quantized_size, block_axes=block_axes,
                         finish=lambda step, param, index: step)

  return optax.GradientTransformation(_init(block_size, min_quantized_size), update_fn)


def adamw_8bit(learning_rate, b1: float, b2: float, weight_decay: float, mask,
               max_grad_norm: float, block_size: int = 2048, eps: float = 1e-8,
               block_axes=None, min_quantized_size: int = 4096) -> optax.GradientTransformation:
  """optax.chain(clip_by_global_norm(max_grad_norm), adamw) with the moments stored in 8 bits, the
  chain fused into the slice loop (see the module docstring). `learning_rate`: a schedule of the
  step count; `mask`: a function of the parameters naming the ones weight decay applies to."""
  _check_block_size(block_size)
  # The unfused chain defines the state (so that checkpoints of either restore into the other).
  reference = optax.chain(
      optax.clip_by_global_norm(max_grad_norm),
      optax.chain(scale_by_adam_8bit(b1, b2, eps, block_size, min_quantized_size, block_axes),
                  optax.add_decayed_weights(weight_decay, mask),
                  optax.scale_by_learning_rate(learning_rate)))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError('adamw_8bit needs the parameters (weight decay): update(..., params)')
    clip_state, (adam_state, decay_state, lr_state) = state
    norm = optax.tree.norm(updates)
    # optax.clip_by_global_norm: gradients above the norm are scaled onto it
    clip = jnp.where(norm < max_grad_norm, 1.0, max_grad_norm / norm)
    lr = learning_rate(lr_state.count) if callable(learning_rate) else learning_rate
    decays = jax.tree.leaves(mask(params) if callable(mask) else mask)

    def finish(step, param, index):
      update = step if not decays[index] else step + weight_decay * param.astype(jnp.float32)
      return -lr * update

    new_updates, adam_state = _adam_updates(
        updates, adam_state, params, b1=b1, b2=b2, eps=eps, block_size=block_size,
        min_quantized_size=min_quantized_size, block_axes=block_axes, finish=finish,
        grad_scale=clip)
    lr_state = lr_state._replace(count=optax.safe_increment(lr_state.count))
    return new_updates, (clip_state, (adam_state, decay_state, lr_state))

  return optax.GradientTransformation(reference.init, update_fn)
