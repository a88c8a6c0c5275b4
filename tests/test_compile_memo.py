"""tests/compile_memo.py: a worker compiles a program once, whichever jit asks for it, and never
hands one program's executable to another."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import compile_memo


pytestmark = pytest.mark.skipif(
    not compile_memo.installed(), reason='the memo is off in this process (SUITE_COMPILE_MEMO=0, '
                                         'or a jax without backend_compile_and_load)')


def _executable(fn, *args):
  return fn.lower(*args).compile().runtime_executable()


def test_two_jits_of_one_program_share_its_executable_and_another_program_does_not():
  x = jnp.arange(8.0)
  first = _executable(jax.jit(lambda v: jnp.sin(v) * 3), x)
  again = _executable(jax.jit(lambda v: jnp.sin(v) * 3), x)   # a new function, the same program
  other = _executable(jax.jit(lambda v: jnp.sin(v) * 4), x)
  longer = _executable(jax.jit(lambda v: jnp.sin(v) * 3), jnp.arange(16.0))
  assert again is first
  assert other is not first and longer is not first
  np.testing.assert_array_equal(jax.jit(lambda v: jnp.sin(v) * 3)(x), jnp.sin(x) * 3)


def test_a_program_with_a_host_callback_is_compiled_for_each_callback():
  seen = []

  def with_callback(tag):
    def fn(v):
      jax.debug.callback(lambda value: seen.append((tag, float(value))), v.sum())
      return v + 1
    return jax.jit(fn)

  x = jnp.ones(4)
  with_callback('a')(x).block_until_ready()
  with_callback('b')(x).block_until_ready()
  jax.effects_barrier()
  assert seen == [('a', 4.0), ('b', 4.0)]
