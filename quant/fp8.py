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

Each product multiplies the fp8 operands themselves, accumulates in fp32 and divides by both scales
(as Qwix's current-scaling product does): on a GPU an fp8 GEMM, on a CPU an emulation (no speed-up
can be seen there). Written as quantize -> dequantize -> 16-bit product instead, XLA:GPU (jax 0.10)
neither rewrote it into an fp8 GEMM nor kept the fp8 rounding: with excess precision allowed (its
default) it dropped the round trip through fp8 and ran fp32 GEMMs, forward and backward (issue 47:
delayed scaling at 0.69x bf16's step on an H200).
"""
import functools
import math

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


def _quantize(x: jax.Array, scale: jax.Array, fmt) -> jax.Array:
  """x * scale in fp8; values beyond the format's range clip."""
  top = float(jnp.finfo(fmt).max)
  return jnp.clip(x.astype(jnp.float32) * scale, -top, top).astype(fmt)


def _amax(x: jax.Array) -> jax.Array:
  return jnp.max(jnp.abs(x)).astype(jnp.float32)


def _push(row: jax.Array, amax: jax.Array) -> jax.Array:
  return jnp.concatenate([amax[None], row[:-1]])


def _scaled_product(a, a_scale, b, b_scale, dims, dtype, product_dtype=jnp.float32):
  """dot_general of two fp8 arrays accumulated in fp32 and delivered in `product_dtype`, divided
  by both scales, in `dtype`."""
  y = jax.lax.dot_general(a, b, dims, preferred_element_type=product_dtype)
  return (y.astype(jnp.float32) / (a_scale * b_scale)).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def fp8_delayed_dot(x: jax.Array, kernel: jax.Array, history: jax.Array, n_in: int) -> jax.Array:
  """x [..., *in] @ kernel [*in, *out] through e4m3 with scales from `history` [3, H]; x and the
  kernel in one dtype (Dense casts both to the compute dtype), which the result and both
  gradients have too."""
  return _forward(x, kernel, history, n_in)[0]


def _forward(x, kernel, history, n_in):
  x_scale, kernel_scale = history_scale(history[X], E4M3), history_scale(history[KERNEL], E4M3)
  xq, kq = _quantize(x, x_scale, E4M3), _quantize(kernel, kernel_scale, E4M3)
  # The forward's product is delivered in x's dtype: it is the matmul output `remat=dots` saves
  # (a whole layer stack of them), which in fp32 took twice the memory of the bf16 step's. Not in
  # fp16, whose range the scaled product (up to 448**2 a term) would overflow.
  delivered = jnp.float32 if x.dtype == jnp.float16 else x.dtype
  y = _scaled_product(xq, x_scale, kq, kernel_scale, dense_dims(x, n_in), x.dtype, delivered)
  # The fp8 operands are what the backward needs: a byte per value, not the compute dtype's two.
  return y, (xq, x_scale, kq, kernel_scale, history, _amax(x), _amax(kernel))


def _backward(n_in, residuals, g):
  xq, x_scale, kq, kernel_scale, history, x_amax, kernel_amax = residuals
  g_scale = history_scale(history[GRAD], E5M2)
  inner = math.prod(kq.shape[:n_in])
  rows, matrix = xq.reshape(-1, inner), kq.reshape(inner, -1)
  gq = _quantize(g, g_scale, E5M2).reshape(rows.shape[0], matrix.shape[1])
  dx = _scaled_product(gq, g_scale, matrix, kernel_scale, (((1,), (1,)), ((), ())), g.dtype)
  dkernel = _scaled_product(rows, x_scale, gq, g_scale, (((0,), (0,)), ((), ())), g.dtype)
  updated = jnp.stack([_push(history[X], x_amax), _push(history[KERNEL], kernel_amax),
                       _push(history[GRAD], _amax(g))])
  return dx.reshape(xq.shape), dkernel.reshape(kq.shape), updated - history


fp8_delayed_dot.defvjp(_forward, _backward)


def is_history(path) -> bool:
  """Whether a parameter path (from tree_map_with_path) names an amax history."""
  return getattr(path[-1], 'key', None) == 'amax_history'
