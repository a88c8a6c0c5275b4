"""parallel/hlo_arrays.py reads the sizes XLA itself prints: each dtype's array in a compiled
program's entry layout has the bytes JAX gives the same array."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from parallel.hlo_arrays import arrays, dtype_bits, type_bytes

DTYPES = ('bool', 'int8', 'uint8', 'int16', 'float16', 'bfloat16', 'float32', 'int32', 'uint32',
          'float8_e4m3fn', 'float8_e5m2', 'int4', 'complex64')


@pytest.mark.parametrize('name', DTYPES)
def test_an_arrays_bytes_are_what_jax_stores(name):
  dtype = jnp.dtype(name)
  x = jnp.zeros((3, 5), dtype)
  header = jax.jit(lambda a: a).lower(x).compile().as_text().split('\n', 1)[0]
  parameters = header.split('entry_computation_layout={(', 1)[1].split(')->', 1)[0]
  (size, _), = arrays(parameters)
  bits = 4 if name == 'int4' else dtype.itemsize * 8   # ml_dtypes gives int4 a byte; XLA packs it
  assert size == math.ceil(x.size * bits / 8)


def test_a_tuple_and_the_names_without_a_width():
  assert type_bytes('(f32[2,3]{1,0}, bf16[4]{0}, s32[], token[])') == 24 + 8 + 4 + 0
  assert dtype_bits('pred') == 8 and dtype_bits('token') == 0 and dtype_bits('c128') == 128
  assert arrays('bf16[8,256]{1,0:S(5)}') == [(2 * 8 * 256, '1,0:S(5)')]
  assert np.dtype('float64').itemsize * 8 == dtype_bits('f64')
