"""LLM.int8() matrix multiplication: vector-wise int8 with a 16-bit path for outlier features.

After Dettmers et al. 2022, "LLM.int8(): 8-bit Matrix Multiplication for Transformers at Scale",
written here from the paper (no JAX library has it). A few hidden features of large transformers
carry values far above the rest; one such value would set a whole row's int8 scale and crush the
others to zero. So the feature columns of x where any |value| exceeds `threshold` (and the matching
rows of the kernel) go through a 16-bit matmul, and the rest through int8 x int8 -> int32 with an
absmax scale per row of x and per output column of the kernel. The two parts are summed.

This module owns the forward product, its straight-through gradient and the outlier statistics
used to report how much of a layer took the 16-bit path. It does not own storage: the kernel is
quantized on the fly from whatever dtype it is kept in.
"""
import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from quant.contraction import dense_dims

INT8_MAX = 127

# Set by `recording_outliers()`: each traced product then reports (outlier columns, columns) from
# the device as it runs (a layer of the scanned stack reports once per layer).
_recorder: list | None = None


@contextlib.contextmanager
def recording_outliers():
  """Collects (outlier columns, feature columns) of every LLM.int8() product traced inside the
  `with` block and run afterwards (jit caches traced outside it do not record)."""
  global _recorder
  records, previous = [], _recorder
  _recorder = records
  try:
    yield records
  finally:
    _recorder = previous


def _check(x: jax.Array, kernel: jax.Array | None, n_in: int, threshold: float) -> None:
  if not threshold > 0:   # written so that NaN is refused too
    raise ValueError(f'threshold={threshold!r}; allowed: a number > 0')
  if not 1 <= n_in <= x.ndim:
    raise ValueError(f'n_in={n_in} must be between 1 and x.ndim={x.ndim}')
  if kernel is not None and (n_in > kernel.ndim or x.shape[x.ndim - n_in:] != kernel.shape[:n_in]):
    raise ValueError(f'x {x.shape} trailing {n_in} dims do not match kernel {kernel.shape}')


def _rows(x: jax.Array, n_in: int) -> jax.Array:
  """x [..., *in_dims] -> [M, K]: every leading position is one row, every in-feature one column."""
  return x.reshape(-1, math.prod(x.shape[x.ndim - n_in:]))


def outlier_columns(x: jax.Array, n_in: int, threshold: float = 6.0) -> jax.Array:
  """bool[K]: the flattened feature columns where any row of x exceeds `threshold` in magnitude."""
  _check(x, None, n_in, threshold)
  return jnp.any(jnp.abs(_rows(x, n_in)) > threshold, axis=0)


def outlier_share(x: jax.Array, n_in: int, threshold: float = 6.0) -> jax.Array:
  """Fraction of feature columns that are outliers, as a 0-d float32 array (float() it to print)."""
  return jnp.mean(outlier_columns(x, n_in, threshold).astype(jnp.float32))


def quantize_vectorwise(a: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """Symmetric absmax int8 along `axis`: (int8 codes, float32 scales with `axis` kept as size 1)."""
  a = a.astype(jnp.float32)
  absmax = jnp.max(jnp.abs(a), axis=axis, keepdims=True)
  # Multiply by the float32 reciprocal rather than divide: XLA rewrites a division by a constant
  # into exactly this, so writing it out keeps the scales bit-identical to a reference elsewhere.
  scale = jnp.where(absmax > 0, absmax * jnp.float32(1 / INT8_MAX), 1.0)   # all-zero: no 0 / 0
  return jnp.clip(jnp.round(a / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def int8_part(x2: jax.Array, w2: jax.Array, outliers: jax.Array):
  """The int8 half of the product on 2-D operands: (int32 [M, N] accumulator, x scales [M, 1],
  kernel scales [1, N]). Exposed so that tests can pin the integer arithmetic exactly."""
  # Masks, not gathers: how many columns are outliers depends on the data, and under jit every shape
  # must be known at trace time. Zeroing keeps [M, K] x [K, N] static at the cost of a full-width
  # 16-bit matmul; a GPU kernel (bitsandbytes) instead gathers the few outlier columns into a
  # small [M, k_out] x [k_out, N] product, which is where the method's speed and memory come from.
  xq, x_scale = quantize_vectorwise(jnp.where(outliers[None, :], 0, x2), axis=1)
  wq, w_scale = quantize_vectorwise(jnp.where(outliers[:, None], 0, w2), axis=0)
  acc = jax.lax.dot_general(xq, wq, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  return acc, x_scale, w_scale


def _flat(x, kernel, n_in):
  out_dims = kernel.shape[n_in:]
  x2 = _rows(x, n_in)
  return x2, kernel.reshape(x2.shape[1], -1), x.shape[:x.ndim - n_in] + out_dims


def _forward(x, kernel, n_in, threshold, compute_dtype):
  x2, w2, out_shape = _flat(x, kernel, n_in)
  outliers = jnp.any(jnp.abs(x2) > threshold, axis=0)
  if _recorder is not None:
    records = _recorder
    jax.debug.callback(lambda n, k=x2.shape[1]: records.append((int(n), k)), outliers.sum())
  acc, x_scale, w_scale = int8_part(x2, w2, outliers)
  int8_y = acc.astype(jnp.float32) * x_scale * w_scale
  x16 = jnp.where(outliers[None, :], x2.astype(compute_dtype), 0)
  w16 = jnp.where(outliers[:, None], w2.astype(compute_dtype), 0)
  wide_y = jax.lax.dot_general(x16, w16, (((1,), (0,)), ((), ())),
                               preferred_element_type=jnp.float32)
  return (int8_y + wide_y).astype(compute_dtype).reshape(out_shape)


def _plain(x, kernel, n_in, compute_dtype):
  """The unquantized product whose gradient the backward pass uses."""
  y = jax.lax.dot_general(x.astype(compute_dtype), kernel.astype(compute_dtype),
                          dense_dims(x, n_in), preferred_element_type=jnp.float32)
  return y.astype(compute_dtype)


# Straight-through: rounding has zero gradient almost everywhere, so training through the int8
# forward takes the gradient of the unquantized product (the quantization error is treated as noise).
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _llm_int8(x, kernel, n_in, threshold, compute_dtype):
  return _forward(x, kernel, n_in, threshold, compute_dtype)


def _llm_int8_fwd(x, kernel, n_in, threshold, compute_dtype):
  return _forward(x, kernel, n_in, threshold, compute_dtype), (x, kernel)


def _llm_int8_bwd(n_in, threshold, compute_dtype, residuals, g):
  _, pullback = jax.vjp(lambda x, kernel: _plain(x, kernel, n_in, compute_dtype), *residuals)
  return pullback(g)


_llm_int8.defvjp(_llm_int8_fwd, _llm_int8_bwd)


def llm_int8_dot(x: jax.Array, kernel: jax.Array, n_in: int, threshold: float = 6.0,
                 compute_dtype=jnp.bfloat16) -> jax.Array:
  """y[..., *out_dims] = x[..., *in_dims] . kernel[*in_dims, *out_dims] by LLM.int8(), in compute_dtype.

  Outliers are decided over all rows of this call: under data parallelism that is one all-reduce
  of a bool[K], which the compiler inserts."""
  _check(x, kernel, n_in, threshold)
  return _llm_int8(x, kernel, n_in, float(threshold), compute_dtype)
