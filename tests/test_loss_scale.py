"""fp16 dynamic loss scaling rules."""
import jax.numpy as jnp

from precision.loss_scale import all_finite, init_loss_scale, update_loss_scale


def test_overflow_halves_and_resets_the_count():
  state = {'scale': jnp.float32(1024.0), 'good_steps': jnp.int32(7)}
  new = update_loss_scale(state, jnp.asarray(False))
  assert float(new['scale']) == 512.0 and int(new['good_steps']) == 0


def test_scale_doubles_after_a_period_of_finite_steps():
  state = init_loss_scale(8.0)
  for _ in range(3):
    state = update_loss_scale(state, jnp.asarray(True), period=3)
  assert float(state['scale']) == 16.0 and int(state['good_steps']) == 0


def test_scale_never_falls_below_the_minimum():
  state = {'scale': jnp.float32(1.0), 'good_steps': jnp.int32(0)}
  assert float(update_loss_scale(state, jnp.asarray(False))['scale']) == 1.0


def test_all_finite_sees_inf_and_nan_anywhere_in_the_tree():
  assert bool(all_finite({'a': jnp.ones(3), 'b': [jnp.zeros(2)]}))
  assert not bool(all_finite({'a': jnp.ones(3), 'b': [jnp.array([0.0, jnp.inf])]}))
  assert not bool(all_finite({'a': jnp.array([jnp.nan])}))
