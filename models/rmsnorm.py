"""RMSNorm's arithmetic, x * rsqrt(mean(x^2) + eps) * scale in fp32, and a backward that keeps only
the input and one fp32 number per row.

Differentiated by autodiff, the norm keeps fp32 forms of its input and of its normalised output
for the backward: the 1b step with remat none compiled for one H200 held four fp32 [tokens,
d_model] stacks per layer for its two norms, 8 GiB in all, written in the forward and read back in
the backward. `rms_norm` keeps the input as it came (the compute dtype) and the row's reciprocal
root, and forms the gradient in one pass from them. The forward is the plain one's, bit for bit.
"""
import functools

import jax
import jax.numpy as jnp


def normalize(x: jax.Array, scale: jax.Array, eps: float, dtype) -> tuple[jax.Array, jax.Array]:
  """(the norm's output in `dtype`, the reciprocal root of each row's mean square, [..., 1] fp32)."""
  x32 = x.astype(jnp.float32)
  inverse_root = jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return ((x32 * inverse_root) * scale.astype(jnp.float32)).astype(dtype), inverse_root


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
  return normalize(x, scale, eps, dtype)[0]


def _forward(x, scale, eps, dtype):
  out, inverse_root = normalize(x, scale, eps, dtype)
  return out, (x, scale, inverse_root)


def _backward(eps, dtype, residuals, g):
  del eps, dtype
  x, scale, inverse_root = residuals
  normed = x.astype(jnp.float32) * inverse_root
  g32 = g.astype(jnp.float32)
  d_scale = jnp.sum(g32 * normed, axis=tuple(range(x.ndim - 1)))
  scaled = g32 * scale.astype(jnp.float32)
  # d/dx of x * r with r = (mean(x^2) + eps)^(-1/2): r * (s - n * mean(s * n)), n = x * r.
  d_x = inverse_root * (scaled - normed * jnp.mean(scaled * normed, axis=-1, keepdims=True))
  return d_x.astype(x.dtype), d_scale.astype(scale.dtype)


rms_norm.defvjp(_forward, _backward)
