"""quant/contraction.py: the dense product as a 2-D matmul computes what dot_general computes,
forward and backward, and keeps no second copy of its input inside a layer scan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant.contraction import dense_dims, dense_product


def _reference(x, kernel, n_in):
  return jax.lax.dot_general(x, kernel, dense_dims(x, n_in), precision='highest')


# x [batch, length, *in], kernel [*in, *out]: one input and one output dim (an MLP), one in and two
# out (the query projection [embed] -> [heads, head_dim]), two in and one out (the output
# projection [heads, head_dim] -> [embed]).
SHAPES = [((2, 8, 16), (16, 24), 1), ((2, 8, 16), (16, 4, 6), 1), ((2, 8, 4, 6), (4, 6, 16), 2)]


@pytest.mark.parametrize('x_shape,kernel_shape,n_in', SHAPES)
def test_values_and_gradients_are_those_of_dot_general(x_shape, kernel_shape, n_in):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=x_shape), jnp.float32)
  kernel = jnp.asarray(rng.normal(size=kernel_shape), jnp.float32)
  cotangent = jnp.asarray(rng.normal(size=x_shape[:x.ndim - n_in] + kernel_shape[n_in:]),
                          jnp.float32)

  def pullback(product, x, kernel, cotangent):
    y, vjp = jax.vjp(lambda a, b: product(a, b, n_in), x, kernel)
    return (y, *vjp(cotangent))

  ours = jax.jit(pullback, static_argnums=0)(dense_product, x, kernel, cotangent)
  reference = jax.jit(pullback, static_argnums=0)(_reference, x, kernel, cotangent)
  # Each result is a sum of n products, rounded in another order: both within n * 2**-24 of the
  # exact sum times the sum of the terms' magnitudes, which is the same pullback taken of |x|,
  # |kernel| and |cotangent|.
  magnitudes = jax.jit(pullback, static_argnums=0)(_reference, abs(x), abs(kernel), abs(cotangent))
  n = max(x.size // np.prod(kernel_shape[:n_in]), np.prod(kernel_shape))
  for got, want, bound, name in zip(ours, reference, magnitudes, ('y', 'dx', 'dkernel')):
    assert got.shape == want.shape and got.dtype == want.dtype, name
    assert np.all(np.abs(np.asarray(got) - want) <= 2 * n * 2.0**-24 * np.asarray(bound)), name


def test_bf16_gradients_are_within_a_bf16_rounding_of_the_fp32_ones():
  rng = np.random.default_rng(1)
  x = rng.normal(size=(4, 8, 32)).astype(np.float32)
  kernel = rng.normal(size=(32, 16)).astype(np.float32)
  loss = lambda product, a, b: (product(a, b, 1).astype(jnp.float32) ** 2).sum()
  exact = jax.grad(lambda a, b: loss(_reference, a, b), argnums=(0, 1))(x, kernel)
  bf16 = jax.grad(lambda a, b: loss(dense_product, a, b), argnums=(0, 1))(
      jnp.asarray(x, jnp.bfloat16), jnp.asarray(kernel, jnp.bfloat16))
  for got, want in zip(bf16, exact):
    assert got.dtype == jnp.bfloat16
    # Inputs, products and the results each rounded to bf16 (8 significant bits): a few units of
    # 2**-8 relative to the gradient's scale.
    scale = np.abs(np.asarray(want)).max()
    np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=8 * 2.0**-8 * scale)


def test_the_scanned_train_step_keeps_no_second_copy_of_the_inputs(monkeypatch):
  """The blocks' scan saves each dense input for the backward pass. A reshaped copy saved beside
  the input other operations keep (a plain reshape before the dot does that) would add to the
  activations the compiled step holds: the tiny preset's step holds no more than with
  dot_general's own products."""
  import quant.matmul
  from train.run import compile_train_step, setup
  from helpers import tiny_config

  def temp_bytes():
    s = setup(tiny_config(), devices=jax.devices()[:1])
    return compile_train_step(s).memory_analysis().temp_size_in_bytes

  ours = temp_bytes()
  monkeypatch.setattr(quant.matmul, 'dense_product', lambda x, kernel, n_in, out_dtype=None, **_:
                      jax.lax.dot_general(x, kernel, dense_dims(x, n_in),
                                          preferred_element_type=out_dtype))
  assert ours <= temp_bytes()
