"""Adam with 8-bit moments (block-wise dynamic quantization), as an optax GradientTransformation.

optax has no 8-bit optimizer state; this is the bitsandbytes scheme written for JAX: each step the
two moments are dequantized to fp32, updated exactly as in Adam, and quantized back (one byte per
value plus one fp32 scale per block). Tensors with fewer than `min_quantized_size` elements (norm
scales, biases) keep fp32 moments: they cost little and are the most sensitive. The first moment
uses the signed code book, the second (never negative) the unsigned one, which spends all 256
values on magnitudes.
"""
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax

from quant.blockwise import dequantize_blockwise, quantize_blockwise

BLOCK_SIZES = (256, 2048)


class ScaleByAdam8bitState(NamedTuple):
  count: jax.Array
  mu: optax.Updates   # per leaf: fp32 array, or {'codes': uint8, 'scale': fp32} when quantized
  nu: optax.Updates


def scale_by_adam_8bit(b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                       block_size: int = 2048, min_quantized_size: int = 4096
                       ) -> optax.GradientTransformation:
  if block_size not in BLOCK_SIZES:
    raise ValueError(f'quant.adam_block_size={block_size}; allowed: {", ".join(map(str, BLOCK_SIZES))}')

  def quantized(p) -> bool:
    return p.size >= min_quantized_size

  def store(x, p, signed):
    return quantize_blockwise(x, block_size, signed) if quantized(p) else x.astype(jnp.float32)

  def load(stored, p, signed):
    return dequantize_blockwise(stored, p.shape, signed) if quantized(p) else stored

  def init_fn(params):
    zeros = lambda p, signed: store(jnp.zeros(p.shape, jnp.float32), p, signed)
    return ScaleByAdam8bitState(
        count=jnp.zeros([], jnp.int32),
        mu=jax.tree.map(lambda p: zeros(p, True), params),
        nu=jax.tree.map(lambda p: zeros(p, False), params))

  def update_fn(updates, state, params=None):
    del params
    count = optax.safe_increment(state.count)
    is_leaf = lambda x: isinstance(x, dict) and set(x) == {'codes', 'scale'}

    def one(g, mu_stored, nu_stored):
      mu = b1 * load(mu_stored, g, True) + (1 - b1) * g.astype(jnp.float32)
      nu = b2 * load(nu_stored, g, False) + (1 - b2) * jnp.square(g.astype(jnp.float32))
      mu_hat = mu / (1 - b1 ** count.astype(jnp.float32))
      nu_hat = nu / (1 - b2 ** count.astype(jnp.float32))
      step = (mu_hat / (jnp.sqrt(nu_hat) + eps)).astype(g.dtype)
      return step, store(mu, g, True), store(nu, g, False)

    flat_updates, treedef = jax.tree.flatten(updates)
    flat_mu = jax.tree.leaves(state.mu, is_leaf=is_leaf)
    flat_nu = jax.tree.leaves(state.nu, is_leaf=is_leaf)
    results = [one(g, m, v) for g, m, v in zip(flat_updates, flat_mu, flat_nu)]
    steps, mus, nus = zip(*results) if results else ((), (), ())
    return (jax.tree.unflatten(treedef, steps),
            ScaleByAdam8bitState(count, jax.tree.unflatten(treedef, mus),
                                 jax.tree.unflatten(treedef, nus)))

  return optax.GradientTransformation(init_fn, update_fn)


def adamw_8bit(learning_rate, b1: float, b2: float, weight_decay: float, mask,
               block_size: int = 2048, eps: float = 1e-8) -> optax.GradientTransformation:
  """optax.adamw with the moments stored in 8 bits."""
  return optax.chain(
      scale_by_adam_8bit(b1, b2, eps, block_size),
      optax.add_decayed_weights(weight_decay, mask),
      optax.scale_by_learning_rate(learning_rate))
