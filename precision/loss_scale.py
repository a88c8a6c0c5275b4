"""Dynamic loss scaling for fp16 training.

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. Multiplying the loss by a large
scale lifts them into range; when that overflows (an inf or nan in the gradients) the step is
skipped and the scale halved; after `period` clean steps the scale doubles again.
"""
import jax
import jax.numpy as jnp

MIN_LOSS_SCALE = 1.0


def init_loss_scale(initial: float = 2.0**15) -> dict:
  return {'scale': jnp.asarray(initial, jnp.float32), 'good_steps': jnp.asarray(0, jnp.int32)}


def all_finite(tree) -> jax.Array:
  leaves = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
  return jnp.stack(leaves).all() if leaves else jnp.asarray(True)


def update_loss_scale(state: dict, grads_finite: jax.Array, *, period: int = 2000,
                      factor: float = 2.0, minimum: float = MIN_LOSS_SCALE) -> dict:
  """Halve on overflow, double after `period` consecutive finite steps."""
  good = jnp.where(grads_finite, state['good_steps'] + 1, 0)
  grow = good >= period
  scale = jnp.where(grads_finite,
                    jnp.where(grow, state['scale'] * factor, state['scale']),
                    jnp.maximum(state['scale'] / factor, minimum))
  return {'scale': scale, 'good_steps': jnp.where(grow, 0, good)}
