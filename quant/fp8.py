"""fp8 matmul with delayed scaling: each operand's scale comes from the largest absolute value seen
over the last H steps (its amax history), never from the tensor at hand, so no pass over the tensor
has to finish before it can be cast (the Transformer Engine recipe, written here for JAX). The
current tensor's amax only enters the history, for the next step. With nothing recorded yet (the
first step) the scale is 1, as Transformer Engine starts: values beyond the format's range clip.

Forward operands are e4m3 (3 fraction bits), the incoming gradient e5m2 (2 fraction bits, 8x the
range). Each Dense keeps one history per operand, [3 (x, kernel, gradient), H], as a parameter.
It cannot be an ordinary parameter: its new value is only known in the backward pass, where the
gradient's absolute max is seen. So the backward pass returns (updated history - history) as its
"gradient", and the optimizer adds it instead of running Adam on it (optim/adamw.py). The train
step combines these by their maximum, not their sum, over microbatches and over devices where it
takes gradients per device (train/step.py: `combine`), and never divides them: the newest entry is
the amax of the whole batch, so every layout records, and scales by, the same values.

The product is written as quantize -> dequantize -> dot: on a GPU XLA rewrites that pattern into an
fp8 GEMM; on this CPU it runs as an emulation (no speed-up can be seen here).
"""
import functools

import jax
import jax.numpy as jnp
from flax import nnx

from quant.contraction import dense_dims

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
X, KERNEL, GRAD = 0, 1, 2


class AmaxHistory(nnx.Param):
  """[3, H] absolute maxima of (x, kernel, gradient), newest first: updated by its 'gradient'."""


def new_history(length: int) -> AmaxHistory:
  return AmaxHistory(jnp.zeros((3, length), jnp.float32), out_sharding=(None, None),
                     eager_sharding=False)


def history_scale(history_row: jax.Array, fmt) -> jax.Array:
  """fp8 max / the history's amax; 1 while nothing is recorded."""
  amax = jnp.max(history_row)
  return jnp.where(amax > 0, float(jnp.finfo(fmt).max) / jnp.maximum(amax, 1e-30), 1.0)


def _quantize_dequantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
  top = float(jnp.finfo(fmt).max)
  q = jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(fmt)   # values beyond the range clip
  return (q.astype(jnp.float32) / scale).astype(x.dtype)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _push(row: jax.Array, amax: jax.Array) -> jax.Array:
  return jnp.concatenate([amax[None], row[:-1]])


def _product(x, kernel, n_in):
  return jax.lax.dot_general(x, kernel, dense_dims(x, n_in), preferred_element_type=jnp.float32
                             ).astype(x.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_delayed_dot(x: jax.Array, kernel: jax.Array, history: jax.Array, n_in: int) -> jax.Array:
  """x [..., *in] @ kernel [*in, *out] through e4m3 with scales from `history` [3, H]."""
  return _forward(x, kernel, history, n_in)[0]


def _forward(x, kernel, history, n_in):
  x_amax, kernel_amax = _amax(x), _amax(kernel)
  xq = _quantize_dequantize(x, history_scale(history[X], E4M3), E4M3)
  kq = _quantize_dequantize(kernel, history_scale(history[KERNEL], E4M3), E4M3)
  return _product(xq, kq, n_in), (xq, kq, history, x_amax, kernel_amax)


def _backward(n_in, residuals, g):
  xq, kq, history, x_amax, kernel_amax = residuals
  g_amax = _amax(g)
  gq = _quantize_dequantize(g, history_scale(history[GRAD], E5M2), E5M2)
  _, pullback = jax.vjp(lambda a, b: _product(a, b, n_in), xq, kq)
  dx, dkernel = pullback(gq)
  updated = jnp.stack([_push(history[X], x_amax), _push(history[KERNEL], kernel_amax),
                       _push(history[GRAD], g_amax)])
  return dx, dkernel, updated - history


fp8_delayed_dot.defvjp(_forward, _backward)


def is_history(path) -> bool:
  """Whether a parameter path (from tree_map_with_path) names an amax history."""
  return getattr(path[-1], 'key', None) == 'amax_history'
