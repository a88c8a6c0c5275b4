"""AdamW with linear warmup, cosine decay and global-norm clipping (optax); the moments in the
parameters' dtype, or in fp32 beside an fp32 master copy of 16-bit weights (optim/master.py), or in
8 bits (optim/adam8bit.py); fp8 amax histories beside it."""
import jax
import jax.numpy as jnp
import optax

from optim.adam8bit import adamw_8bit
from optim.decay import weight_decay_mask
from optim.master import with_master_weights
from quant.fp8 import is_history

ADAM_BITS = (32, 8)


def learning_rate_schedule(train_cfg) -> optax.Schedule:
  warmup = min(train_cfg.warmup_steps, max(train_cfg.steps - 1, 0))
  # Start the warmup at peak / warmup rather than 0, so that the first step is not wasted.
  return optax.warmup_cosine_decay_schedule(
      init_value=train_cfg.learning_rate / max(warmup, 1),
      peak_value=train_cfg.learning_rate,
      warmup_steps=warmup,
      decay_steps=max(train_cfg.steps, warmup + 1),
      end_value=train_cfg.learning_rate * train_cfg.min_lr_ratio,
  )


def schedule_at(opt_state, step: jax.Array):
  """`opt_state` with the learning-rate schedule's count set to `step` (the train step).

  optax keeps the schedule's own count (`ScaleByScheduleState`, in the 32- and 8-bit chains alike),
  which moves only when an update is applied; the train step skips the update of a non-finite step
  (train/step.py), so after k skips that count, and the rate, would be k steps behind the train
  step, and the decay would never reach its end. Set before each update, the applied rate is
  always the schedule of the train step. Adam's own count (its bias correction) still counts the
  updates applied to its moments."""
  def visit(node):
    if isinstance(node, optax.ScaleByScheduleState):
      return node._replace(count=jnp.asarray(step, node.count.dtype))
    return node
  return jax.tree.map(visit, opt_state, is_leaf=lambda n: isinstance(n, optax.ScaleByScheduleState))


def clip_by_global_norm(max_norm: float, norm=None) -> optax.GradientTransformation:
  """optax.clip_by_global_norm (the same state, the same arithmetic), taking the gradients' global
  norm from `norm` where given: an update run a layer at a time (train/offload.py) sees one
  layer's gradients, not all of them."""
  if norm is None:
    return optax.clip_by_global_norm(max_norm)

  def update_fn(updates, state, params=None):
    del params
    clip = lambda t: jax.lax.select(norm < max_norm, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(clip, updates), state

  return optax.GradientTransformation(optax.init_empty_state, update_fn)


def make_optimizer(train_cfg, adam_bits: int = 32, block_size: int = 2048,
                   amax_histories: bool = False, block_axes=None,
                   master_dtype=None, global_norm=None) -> optax.GradientTransformation:
  """AdamW with clipping. With `amax_histories` (fp8 delayed scaling), the histories' 'gradients'
  are their updates (quant/fp8.py): they are added as they are, outside clipping and Adam.
  `block_axes`: 8-bit moments only, the dimension each is blocked from (train/state.py).
  `master_dtype`: clipping and Adam run on a master copy of the weights in this dtype, kept in the
  optimizer state (the policy's; None: on the weights themselves). `global_norm`: the gradients'
  norm for clipping, computed by the caller (None: from the gradients the update is given)."""
  schedule = learning_rate_schedule(train_cfg)
  if amax_histories and block_axes is not None:
    # Adam sees the histories as masked (optax.multi_transform below): so must their block axes.
    block_axes = jax.tree_util.tree_map_with_path(
        lambda path, axis: optax.MaskedNode() if is_history(path) else axis, block_axes)
  if adam_bits == 8:   # clipping fused into the 8-bit update (optim/adam8bit.py)
    tx = adamw_8bit(schedule, b1=train_cfg.b1, b2=train_cfg.b2,
                    weight_decay=train_cfg.weight_decay, mask=weight_decay_mask,
                    max_grad_norm=train_cfg.grad_clip, block_size=block_size,
                    block_axes=block_axes)
  else:
    tx = optax.chain(clip_by_global_norm(train_cfg.grad_clip, global_norm),
                     optax.adamw(schedule, b1=train_cfg.b1, b2=train_cfg.b2,
                                 weight_decay=train_cfg.weight_decay, mask=weight_decay_mask))
  if master_dtype is not None:
    tx = with_master_weights(tx, master_dtype)
  if not amax_histories:
    return tx
  label = lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: 'history' if is_history(path) else 'weights', params)
  return optax.multi_transform({'weights': tx, 'history': optax.identity()}, label)
