"""NF4 storage: the code book, the block-wise round trip, double quantization, packing, bytes."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from quant import nf4
from quant.blockwise import dynamic_code

PUBLISHED_NF4 = [
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
    0.7229568362236023, 1.0]

HALF_GAP = float(np.max(np.diff(nf4.nf4_code()))) / 2


def normal_weights(shape, seed=0):
  return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def block_error_and_absmax(w, y, block_size):
  err = np.abs(np.asarray(w, np.float32) - np.asarray(y, np.float32)).reshape(-1, block_size)
  absmax = np.abs(np.asarray(w, np.float32)).reshape(-1, block_size).max(axis=1)
  return err.max(axis=1), absmax


def test_code_book_matches_the_published_values_sorted_with_exact_zero_and_unit_ends():
  code = nf4.nf4_code()
  np.testing.assert_allclose(code, PUBLISHED_NF4, atol=1e-4)
  assert code.dtype == np.float32 and np.all(np.diff(code) > 0)
  assert code[0] == -1.0 and code[-1] == 1.0 and code[7] == 0.0
  assert np.sum(code > 0) == 8 and np.sum(code < 0) == 7


def test_every_code_value_maps_to_its_own_index_and_midpoints_round_to_a_neighbour():
  code = nf4.nf4_code()
  assert np.array_equal(nf4.nearest_code_index(jnp.asarray(code)), np.arange(16))
  just_above = (code[:-1] + code[1:]) / 2 + 1e-6
  assert np.array_equal(nf4.nearest_code_index(jnp.asarray(just_above)), np.arange(1, 16))


def test_nearest_code_index_agrees_with_a_brute_force_search():
  x = np.random.default_rng(1).uniform(-1, 1, size=4096).astype(np.float32)
  brute = np.argmin(np.abs(x[:, None] - nf4.nf4_code()[None, :]), axis=1)
  assert np.array_equal(nf4.nearest_code_index(jnp.asarray(x)), brute)


def test_pack_unpack_round_trip_is_exact_and_halves_the_bytes():
  indices = jnp.asarray(np.random.default_rng(0).integers(0, 16, size=(3, 64)), jnp.uint8)
  packed = nf4.pack_4bit(indices)
  assert packed.dtype == jnp.uint8 and packed.shape == (3, 32)
  assert np.array_equal(nf4.unpack_4bit(packed), indices)
  assert int(nf4.pack_4bit(jnp.asarray([[3, 12]], jnp.uint8))[0, 0]) == 3 | 12 << 4
  with pytest.raises(ValueError, match='odd'):
    nf4.pack_4bit(jnp.zeros((5,), jnp.uint8))


def test_round_trip_error_is_within_half_the_largest_code_gap_of_each_block_absmax():
  w = normal_weights((96, 128))
  t = nf4.quantize_nf4(jnp.asarray(w), double_quant=False)
  y = nf4.dequantize_nf4(t)
  assert y.shape == w.shape and y.dtype == jnp.float32
  err, absmax = block_error_and_absmax(w, y, 64)
  assert np.all(err <= HALF_GAP * absmax * (1 + 1e-6))
  np.testing.assert_array_equal(t.scale, absmax)
  # the block maximum itself is exact (it maps to the ±1 end of the code book)
  blocks, yb = w.reshape(-1, 64), np.asarray(y).reshape(-1, 64)
  at_max = np.argmax(np.abs(blocks), axis=1)
  np.testing.assert_array_equal(yb[np.arange(len(yb)), at_max], blocks[np.arange(len(yb)), at_max])


def test_double_quantized_scales_are_within_the_8_bit_dynamic_code_error():
  w = normal_weights((1024, 64)) * np.linspace(0.1, 3.0, 1024, dtype=np.float32)[:, None]
  t = nf4.quantize_nf4(jnp.asarray(w))
  assert t.scale.dtype == jnp.uint8 and t.scale.shape == (4, 256)
  assert t.scale_scale.shape == (4,) and t.scale_mean.shape == ()
  exact = nf4.quantize_nf4(jnp.asarray(w), double_quant=False).scale
  got = nf4.block_absmax(t)
  code = dynamic_code(signed=True)
  # Same bound as the 8-bit optimizer states: half the widest gap, plus the missing -1 entry.
  bound = np.max(np.diff(code)) / 2 + (1 + code[0])
  centred = np.abs(np.asarray(exact) - float(t.scale_mean)).reshape(4, 256)
  err = np.abs(np.asarray(got) - np.asarray(exact)).reshape(4, 256)
  assert np.all(err.max(axis=1) <= bound * centred.max(axis=1) + 1e-6)
  np.testing.assert_allclose(t.scale_scale, centred.max(axis=1), rtol=1e-6)
  # ... and the weights then carry that scale error on top of the NF4 rounding
  w_err, absmax = block_error_and_absmax(w, nf4.dequantize_nf4(t), 64)
  assert np.all(w_err <= HALF_GAP * absmax + err.reshape(-1) + 1e-6)


def test_storage_is_half_a_byte_per_value_plus_the_scales():
  w = jnp.asarray(normal_weights((512, 512)))                       # 4096 blocks, 16 scale blocks
  n = w.size
  plain = nf4.quantize_nf4(w, double_quant=False)
  assert plain.codes.shape == (4096, 32) and plain.codes.dtype == jnp.uint8
  assert nf4.storage_bytes(plain) == n // 2 + 4 * 4096
  assert nf4.bytes_per_value(plain) == 0.5 + 4 / 64
  double = nf4.quantize_nf4(w)
  assert nf4.storage_bytes(double) == n // 2 + 4096 + 4 * 16 + 4
  assert nf4.bytes_per_value(double) == pytest.approx(0.5 + (1 + 4 / 256) / 64 + 4 / n)


def test_bf16_weights_come_back_in_bf16_and_zero_blocks_stay_zero():
  w = jnp.asarray(normal_weights((4, 64))).at[1].set(0.0).astype(jnp.bfloat16)
  y = nf4.dequantize_nf4(nf4.quantize_nf4(w, double_quant=False))
  assert y.dtype == jnp.bfloat16 and np.all(np.asarray(y[1]) == 0)
  assert nf4.dequantize_nf4(nf4.quantize_nf4(w), dtype=jnp.float32).dtype == jnp.float32


def test_quantize_and_dequantize_jit_and_the_tensor_is_a_pytree():
  w = jnp.asarray(normal_weights((256, 64)))
  quantize = jax.jit(nf4.quantize_nf4, static_argnums=(1, 2))
  t = quantize(w, 64, True)
  assert isinstance(t, nf4.NF4Tensor) and len(jax.tree.leaves(t)) == 4
  assert t.shape == (256, 64) and t.block_size == 64
  eager = nf4.quantize_nf4(w)
  np.testing.assert_array_equal(t.codes, eager.codes)
  np.testing.assert_allclose(jax.jit(nf4.dequantize_nf4)(t), nf4.dequantize_nf4(eager), rtol=1e-6)


@pytest.mark.parametrize('shape, block_size', [((3, 50), 64), ((128,), 0), ((126,), 63)])
def test_a_block_size_that_does_not_fit_is_refused_with_a_clear_message(shape, block_size):
  message = (re.escape(f'tensor of shape {shape}') + '.*' +
             re.escape(f'block_size={block_size}; allowed: a positive even block_size that divides '
                       'the element count'))
  with pytest.raises(ValueError, match=message):
    nf4.quantize_nf4(jnp.zeros(shape), block_size=block_size)
