"""LLM.int8(): the 16-bit and int8 paths each exact, outliers rescued, multi-dim kernels, gradients."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant.llm_int8 import int8_part, llm_int8_dot, outlier_columns, outlier_share
from tests.helpers import reordered_rtol

M, K, N = 24, 64, 40
PLANTED = [5, 17, 50]


def _operands(seed=0, m=M, k=K, n=N):
  rng = np.random.default_rng(seed)
  return (rng.standard_normal((m, k)).astype(np.float32),
          (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32))


def _with_outliers(x):
  x = x.copy()
  x[::2, PLANTED] = 20.0   # half the rows carry the large value, the other half stay ordinary
  return x


def _fp32(x, w):
  return np.asarray(jax.lax.dot_general(jnp.asarray(x), jnp.asarray(w), (((1,), (0,)), ((), ())),
                                        precision=jax.lax.Precision.HIGHEST))


def _numpy_vectorwise(a, axis):
  """The same absmax scheme, by hand: int64 codes and float32 scales."""
  absmax = np.max(np.abs(a), axis=axis, keepdims=True)
  scale = np.where(absmax > 0, absmax * np.float32(1 / 127), np.float32(1)).astype(np.float32)
  return np.clip(np.round(a / scale), -127, 127).astype(np.int64), scale


def test_every_column_an_outlier_is_exactly_the_16_bit_matmul():
  x, w = _operands()
  y = llm_int8_dot(jnp.asarray(x), jnp.asarray(w), 1, threshold=1e-3, compute_dtype=jnp.float32)
  assert bool(jnp.all(outlier_columns(jnp.asarray(x), 1, 1e-3)))
  # The same fp32 product in another program, which may add its K terms in another order: within
  # gamma_K of sum |x w| of the exact one each (reordered_rtol).
  error = np.abs(np.asarray(y) - _fp32(x, w))
  assert np.all(error <= reordered_rtol(K) * (np.abs(x) @ np.abs(w))), error.max()


def test_no_outliers_matches_a_hand_computed_integer_product_exactly():
  x, w = _operands(1)
  assert np.abs(x).max() < 6.0
  acc, x_scale, w_scale = int8_part(jnp.asarray(x), jnp.asarray(w), jnp.zeros((K,), bool))
  qx, sx = _numpy_vectorwise(x, axis=1)
  qw, sw = _numpy_vectorwise(w, axis=0)
  assert acc.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(acc), qx @ qw)
  np.testing.assert_array_equal(np.asarray(x_scale), sx)
  np.testing.assert_array_equal(np.asarray(w_scale), sw)

  # Float result: within the rounding error of both operands (at most half a step each) of fp32.
  y = np.asarray(llm_int8_dot(jnp.asarray(x), jnp.asarray(w), 1, compute_dtype=jnp.float32))
  bound = (sx / 2 * np.abs(w).sum(0, keepdims=True) + sw / 2 * np.abs(x).sum(1, keepdims=True)
           + K * sx * sw / 4)
  error = np.abs(y - _fp32(x, w))
  assert np.all(error <= bound * (1 + 1e-5) + 1e-6), (error / bound).max()
  assert error.max() > 0   # the int8 path really ran


def test_planted_outliers_are_found_and_decomposition_beats_plain_int8():
  x, w = _operands(2)
  x = _with_outliers(x)
  found = np.flatnonzero(np.asarray(outlier_columns(jnp.asarray(x), 1, 6.0)))
  np.testing.assert_array_equal(found, PLANTED)
  assert float(outlier_share(jnp.asarray(x), 1, 6.0)) == pytest.approx(len(PLANTED) / K)

  exact = _fp32(x, w)
  y = np.asarray(llm_int8_dot(jnp.asarray(x), jnp.asarray(w), 1, compute_dtype=jnp.float32))
  acc, x_scale, w_scale = int8_part(jnp.asarray(x), jnp.asarray(w), jnp.zeros((K,), bool))
  plain = np.asarray(acc, np.float32) * np.asarray(x_scale) * np.asarray(w_scale)
  # Rows carrying an outlier: plain int8 spends its scale on the 20s (measured ~6x the error).
  decomposed_error = np.abs(y - exact)[::2].mean()
  plain_error = np.abs(plain - exact)[::2].mean()
  assert plain_error > 4 * decomposed_error, (plain_error, decomposed_error)
  assert np.abs(y - exact)[1::2].mean() <= np.abs(plain - exact)[1::2].mean() * 1.05


@pytest.mark.parametrize('x_shape, k_shape, n_in', [
    ((2, 5, 16), (16, 4, 8), 1),       # [embed] -> [heads, head_dim]
    ((2, 5, 4, 8), (4, 8, 16), 2),     # [heads, head_dim] -> [embed]
])
def test_multi_dim_kernels_equal_the_flattened_product(x_shape, k_shape, n_in):
  rng = np.random.default_rng(3)
  x = rng.standard_normal(x_shape).astype(np.float32)
  x.reshape(-1, int(np.prod(x_shape[-n_in:])))[:, 3] = 10.0   # one outlier column through both paths
  kernel = rng.standard_normal(k_shape).astype(np.float32)
  k_in = int(np.prod(k_shape[:n_in]))
  y = llm_int8_dot(jnp.asarray(x), jnp.asarray(kernel), n_in, compute_dtype=jnp.float32)
  flat = llm_int8_dot(jnp.asarray(x.reshape(-1, k_in)), jnp.asarray(kernel.reshape(k_in, -1)), 1,
                      compute_dtype=jnp.float32)
  assert y.shape == x_shape[:-n_in] + k_shape[n_in:]
  np.testing.assert_array_equal(np.asarray(y).reshape(flat.shape), np.asarray(flat))
  assert float(outlier_share(jnp.asarray(x), n_in)) == pytest.approx(1 / k_in)


def test_gradient_is_the_fp32_matmul_gradient():
  x, w = _operands(4)
  x = _with_outliers(x)
  cotangent = jnp.asarray(np.random.default_rng(5).standard_normal((M, N)).astype(np.float32))

  def loss(dot):
    return lambda x, w: jnp.sum(dot(x, w) * cotangent)

  int8_dot = functools.partial(llm_int8_dot, n_in=1, compute_dtype=jnp.float32)
  fp32_dot = lambda x, w: jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
  got = jax.grad(loss(int8_dot), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
  want = jax.grad(loss(fp32_dot), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-5)


def test_runs_under_jit_and_returns_the_compute_dtype():
  x, w = _operands(6)
  x = jnp.asarray(_with_outliers(x))
  w = jnp.asarray(w)
  eager = llm_int8_dot(x, w, 1)
  jitted = jax.jit(llm_int8_dot, static_argnums=(2, 3, 4))(x, w, 1, 6.0, jnp.bfloat16)
  assert jitted.dtype == jnp.bfloat16
  # Summed in fp32, then rounded to bf16: another program's summation order can tip that rounding
  # to the neighbouring bf16 (one ulp, 2**-7 of the value at most), never further.
  np.testing.assert_allclose(np.asarray(jitted, np.float32), np.asarray(eager, np.float32),
                             rtol=2.0**-7)
  share = jax.jit(outlier_share, static_argnums=(1, 2))(x, 1, 6.0)
  assert float(share) == pytest.approx(len(PLANTED) / K)


@pytest.mark.parametrize('threshold', [0.0, -1.0, float('nan')])
def test_threshold_must_be_positive(threshold):
  x, w = _operands()
  with pytest.raises(ValueError, match='allowed: a number > 0'):
    llm_int8_dot(jnp.asarray(x), jnp.asarray(w), 1, threshold=threshold)
  with pytest.raises(ValueError, match='allowed: a number > 0'):
    outlier_columns(jnp.asarray(x), 1, threshold)
