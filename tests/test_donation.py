"""train/donation.py: the step jitted with some of its state held back from donation."""
import jax
import jax.numpy as jnp
import numpy as np

from train.donation import HeldBack


def test_held_leaves_are_not_donated_and_the_step_still_takes_the_whole_state():
  one = jax.sharding.SingleDeviceSharding(jax.devices()[0])

  def step(state, batch):
    return {'a': state['a'] + batch, 'b': state['b'] * 2}, state['a'].sum()
  held_back = HeldBack(step, {'a': True, 'b': False}, {'a': one, 'b': one}, one, one)
  state = {'a': jnp.ones(4), 'b': jnp.arange(3.0)}
  new, total = held_back(state, jnp.float32(1))
  np.testing.assert_array_equal(new['a'], np.full(4, 2.0))
  np.testing.assert_array_equal(new['b'], [0.0, 2.0, 4.0])
  assert float(total) == 4.0
  assert state['b'].is_deleted() and not state['a'].is_deleted()   # donated; held back

  compiled = held_back.lower(new, jnp.float32(1)).compile()
  assert compiled.as_text().startswith('HloModule jit_train_step')   # the program keeps its name
  assert compiled.memory_analysis() is not None
  again, total = compiled(new, jnp.float32(1))
  np.testing.assert_array_equal(again['a'], np.full(4, 3.0))
  assert float(total) == 8.0 and new['b'].is_deleted() and not new['a'].is_deleted()
