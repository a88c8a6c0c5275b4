"""Learned step size quantization (LSQ, Esser et al. 2020) for int4 weights.

The step size s is a parameter trained with the weights. The forward pass uses the fake-quantized
weight round(clip(w / s, qmin, qmax)) * s; rounding passes gradients straight through, clipping
does not. The gradient reaching s is multiplied by g = 1 / sqrt(N * qmax) (N: weights per step
size), because unscaled it is orders of magnitude larger than the weights' and training diverges.
"""
import math

import jax
import jax.numpy as jnp


def int_range(bits: int) -> tuple[int, int]:
  return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def initial_step_size(kernel: jax.Array, n_in: int, bits: int) -> jax.Array:
  """The paper's start, 2 mean|w| / sqrt(qmax), one per output channel (reduced over the inputs)."""
  mean_abs = jnp.abs(kernel.astype(jnp.float32)).mean(axis=tuple(range(n_in)))
  return 2 * mean_abs / math.sqrt(int_range(bits)[1])


def _scale_gradient(x: jax.Array, factor: float) -> jax.Array:
  """Identity forward; the gradient is multiplied by `factor`."""
  return x * factor + jax.lax.stop_gradient(x - x * factor)


def _round_straight_through(x: jax.Array) -> jax.Array:
  return x + jax.lax.stop_gradient(jnp.round(x) - x)


def fake_quantize(kernel: jax.Array, step_size: jax.Array, n_in: int, bits: int) -> jax.Array:
  """kernel [*in, *out], step_size [*out] -> the kernel on the int grid of its step sizes."""
  qmin, qmax = int_range(bits)
  weights_per_step = math.prod(kernel.shape[:n_in])
  step = _scale_gradient(step_size.astype(jnp.float32), 1 / math.sqrt(weights_per_step * qmax))
  levels = _round_straight_through(jnp.clip(kernel.astype(jnp.float32) / step, qmin, qmax))
  return (levels * step).astype(kernel.dtype)
