"""Adam with 8-bit moments (block-wise dynamic quantization), as an optax GradientTransformation.

optax has no 8-bit optimizer state; this is the bitsandbytes scheme written for JAX: each step the
two moments are dequantized to fp32, updated exactly as in Adam, and quantized back (one byte per
value plus one fp32 scale per block). Tensors with fewer than `min_quantized_size` elements (norm
scales, biases) keep fp32 moments: they cost little and are the most sensitive. The first moment
uses the signed code book, the second (never negative) the unsigned one, which spends all 256
values on magnitudes.

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

from quant.blockwise import (dequantize_blocks, from_blocks, quantize_blockwise,
                             quantize_blocks, to_blocks)

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


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 2048, min_quantized_size: int = 4096,
                       block_axes=None) -> optax.GradientTransformation:
  """`block_axes`: a tree like the parameters of the dimension each moment is blocked from (its
  parameter's sharded dimension); None blocks every tensor from dimension 0."""
  if block_size not in BLOCK_SIZES:
    raise ValueError(f'quant.adam_block_size={block_size}; allowed: {", ".join(map(str, BLOCK_SIZES))}')

  def quantized(p) -> bool:
    return p.size >= min_quantized_size

  def store(x, p, signed):
    return quantize_blockwise(x, block_size, signed) if quantized(p) else x.astype(jnp.float32)

  def init_fn(params):
    zeros = lambda p, signed: store(jnp.zeros(p.shape, jnp.float32), p, signed)
    return ScaleByAdam8bitState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: zeros(p, True), params),
        nu=jax.tree.map(lambda p: zeros(p, False), params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)

    correction1 = 1 - b1 ** count.astype(jnp.float32)
    correction2 = 1 - b2 ** count.astype(jnp.float32)

    def adam(g, mu, nu):
      g = g.astype(jnp.float32)
      mu = b1 * mu + (1 - b1) * g
      nu = b2 * nu + (1 - b2) * jnp.square(g)
      return (mu / correction1) / (jnp.sqrt(nu / correction2) + eps), mu, nu

    def one(g, mu_stored, nu_stored, axis):
      if not quantized(g):
        step, mu, nu = adam(g, mu_stored, nu_stored)
        return step.astype(g.dtype), mu, nu
      g = jnp.moveaxis(g, axis, 0)   # a local transpose: the sharded dimension becomes outermost
      blocks = to_blocks(g, block_size)
      slices = math.gcd(blocks.shape[0], UPDATE_SLICES)

      def interleaved(x):   # [blocks, ...] -> [blocks / slices, slices, ...], no copy
        return x.reshape(x.shape[0] // slices, slices, *x.shape[1:])

      # Slice i is rows i, i + slices, ...: every data-parallel shard keeps its own rows, and the
      # buffers are read and written in place through the loop. Each slice's Adam step overwrites
      # that slice's gradient, which is not read again: no separate full-size step buffer.
      def update_slice(i, carry):
        grads_then_steps, mu_q, nu_q = carry
        take = lambda x: jax.lax.dynamic_index_in_dim(x, i, axis=1, keepdims=False)
        put = lambda buf, x: jax.lax.dynamic_update_index_in_dim(buf, x, i, axis=1)
        new_step, mu, nu = adam(take(grads_then_steps),
                                dequantize_blocks(jax.tree.map(take, mu_q), True),
                                dequantize_blocks(jax.tree.map(take, nu_q), False))
        return (put(grads_then_steps, new_step.astype(grads_then_steps.dtype)),
                jax.tree.map(put, mu_q, quantize_blocks(mu, True)),
                jax.tree.map(put, nu_q, quantize_blocks(nu, False)))

      step, mu_q, nu_q = jax.lax.fori_loop(
          0, slices, update_slice,
          (interleaved(blocks), jax.tree.map(interleaved, mu_stored),
           jax.tree.map(interleaved, nu_stored)))
      step = step.reshape(blocks.shape)
      mu_q, nu_q = (jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), q) for q in (mu_q, nu_q))
      step = jnp.moveaxis(from_blocks(step, g.shape), 0, axis)
      return step, mu_q, nu_q

    flat_updates, treedef = jax.tree.flatten(updates)
    flat_mu = jax.tree.leaves(state.mu, is_leaf=is_quantized_moment)
    flat_nu = jax.tree.leaves(state.nu, is_leaf=is_quantized_moment)
    flat_axes = ([0] * len(flat_updates) if block_axes is None else
                 treedef.flatten_up_to(block_axes))
    results = [one(g, m, v, a) for g, m, v, a in zip(flat_updates, flat_mu, flat_nu, flat_axes)]
    steps, mus, nus = zip(*results) if results else ((), (), ())
    return (jax.tree.unflatten(treedef, steps),
            ScaleByAdam8bitState(count, jax.tree.unflatten(treedef, mus),
                                 jax.tree.unflatten(treedef, nus)))

  return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(learning_rate, b1: float, b2: float, weight_decay: float, mask,
               block_size: int = 2048, eps: float = 1e-8, block_axes=None
               ) -> optax.GradientTransformation:
  """optax.adamw with the moments stored in 8 bits."""
  return optax.chain(
      scale_by_adam_8bit(b1, b2, eps, block_size, block_axes=block_axes),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))
