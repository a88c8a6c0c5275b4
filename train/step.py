"""One optimizer step: loss, gradients accumulated over microbatches, loss scaling, update.

Reads top to bottom: split the batch into microbatches, accumulate gradients in the master
weights' dtype, (fp16) unscale and check for overflow, apply AdamW, (fp16) skip the update if the
gradients overflowed.
"""
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from models.sharding import constrain
from quant.loss_scale import all_finite, select_tree, update_loss_scale
from quant.precision import Policy


def cross_entropy(graphdef, params, batch) -> jax.Array:
  """Mean next-token cross-entropy in nats per token."""
  logits = nnx.merge(graphdef, params)(batch['inputs'])
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])
  return losses.mean()


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[batch, ...] -> [microbatches, batch / microbatches, ...], taking rows round-robin so that each
  data-parallel device keeps contributing its own rows to every microbatch (no data movement)."""
  def split(x):
    rows = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
    return constrain(rows, (None, 'batch', 'length'))
  return jax.tree.map(split, batch)


def make_train_step(graphdef, tx: optax.GradientTransformation, policy: Policy, microbatches: int,
                    grad_shardings=None):
  """`grad_shardings`: where gradients (and their accumulator) live. Sharded over `fsdp` (ZeRO-2/3),
  the data-parallel sum becomes a reduce-scatter and each device keeps only its slice."""

  def place(grads):
    return grads if grad_shardings is None else jax.lax.with_sharding_constraint(grads, grad_shardings)

  def train_step(state: dict, batch: dict):
    params = state['params']
    scale = state['loss_scale']['scale'] if policy.loss_scaling else 1.0

    def scaled_loss(p, microbatch):
      loss = cross_entropy(graphdef, p, microbatch)
      return loss * scale, loss

    grad_fn = jax.value_and_grad(scaled_loss, has_aux=True)

    def accumulate(carry, microbatch):
      grad_sum, loss_sum = carry
      (_, loss), grads = grad_fn(params, microbatch)
      return (place(jax.tree.map(jnp.add, grad_sum, place(grads))), loss_sum + loss), None

    zeros = place(jax.tree.map(jnp.zeros_like, params))
    (grad_sum, loss_sum), _ = jax.lax.scan(
        accumulate, (zeros, jnp.zeros((), jnp.float32)), split_microbatches(batch, microbatches))
    grads = jax.tree.map(lambda g: g / (microbatches * scale), grad_sum)
    loss = loss_sum / microbatches

    updates, opt_state = tx.update(grads, state['opt_state'], params)
    new_state = {'step': state['step'] + 1, 'params': optax.apply_updates(params, updates),
                 'opt_state': opt_state, 'loss_scale': state['loss_scale']}
    metrics = {'loss': loss, 'grad_norm': optax.tree.norm(grads)}

    if policy.loss_scaling:
      finite = all_finite(grads)
      new_state = select_tree(finite, new_state, {**state, 'step': state['step'] + 1})
      new_state['loss_scale'] = update_loss_scale(state['loss_scale'], finite)
      metrics.update(loss_scale=state['loss_scale']['scale'], skipped=jnp.logical_not(finite))
    return new_state, metrics

  return train_step
