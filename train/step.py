"""One optimizer step: loss, gradients accumulated over microbatches, loss scaling, update.

Reads top to bottom: split the batch into microbatches, accumulate gradients in the weights'
dtype (one scan; where gradients are replicated, per device, reduced once; fp8 amax histories'
updates by their maximum, quant/fp8.py), (fp16) unscale, apply AdamW unless the loss or a
gradient is not finite (an fp16 overflow, or a run that diverged: the update is skipped on the
device), (fp16) adjust the scale. Gradients are taken of the
trainable parameters only; a frozen base (LoRA) is an input of the loss and passes through the
step unchanged.
"""
import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen, nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from models.hints import constrain
from models.llama import weights_on_device
from optim.adamw import schedule_at
from parallel.in_place import when
from parallel.padding import Shapes, fit
from precision.loss_scale import MIN_LOSS_SCALE, update_loss_scale
from precision.policy import Policy
from quant.fp8 import is_history


def predicted(batch) -> jax.Array:
  """How many targets of `batch` are predicted (a target < 0 is not: padding, or a document's
  first token after the previous document, data/windows.py)."""
  return (batch['targets'] >= 0).sum()


def _model(graphdef, params, frozen):
  # A frozen base in host memory: its block stack streams in a layer at a time inside the model;
  # the embedding, head and final norm come to the device whole.
  frozen = {k: v if k == 'blocks' else weights_on_device(v) for k, v in frozen.items()}
  return nnx.merge(graphdef, params, frozen)


def token_losses(graphdef, params, frozen, batch, dropout_key=None, stack=None) -> jax.Array:
  """Next-token cross-entropy [rows, length] in nats, 0 where a target is not predicted.
  `frozen`: the base weights under LoRA ({} otherwise); `dropout_key`: LoRA dropout on; `stack`:
  how the blocks run (a pipeline; None: one after another). A batch without `segments` is one
  document per row."""
  return _model(graphdef, params, frozen).token_losses(
      batch['inputs'], batch['targets'], segments=batch.get('segments'), dropout_key=dropout_key,
      stack=stack)


def cross_entropy(graphdef, params, frozen, batch, dropout_key=None, stack=None,
                  denominator=None) -> jax.Array:
  """The sum of the batch's token losses over `denominator` (default: its predicted targets, so
  the mean in nats per predicted token)."""
  total = _model(graphdef, params, frozen).loss_sum(
      batch['inputs'], batch['targets'], segments=batch.get('segments'), dropout_key=dropout_key,
      stack=stack)
  return total / loss_denominator(batch, denominator)


def loss_denominator(batch, denominator=None) -> jax.Array:
  """What the loss sum is divided by: `denominator` (default: the batch's predicted targets),
  at least 1, in fp32."""
  denominator = predicted(batch) if denominator is None else denominator
  return jnp.maximum(denominator, 1).astype(jnp.float32)


def split_microbatches(batch: dict, microbatches: int) -> dict:
  """[batch, ...] -> [microbatches, batch / microbatches, ...], taking rows round-robin so that each
  data-parallel device keeps contributing its own rows to every microbatch (no data movement)."""
  def split(x):
    rows = x.reshape(x.shape[0] // microbatches, microbatches, *x.shape[1:]).swapaxes(0, 1)
    return constrain(rows, (None, 'batch', 'length'))
  return jax.tree.map(split, batch)


def apply_updates(params, updates, layer_writes: dict | None = None):
  """optax.apply_updates, each update cut to its weight's shape (formed in the optimizer's
  shapes, which pad what its sharding splits unevenly: parallel/padding.py), except that each
  weight named in `layer_writes` (stacked, stored whole,
  updated in shards: ZeRO-1/2) gets its new values one layer at a time: a layer's slice is updated,
  gathered to that layer's sharding and written into the weight's own buffer (donated, so in
  place) before the next. Gathered at once, the whole stack's new values would be a second,
  full-size copy (XLA gathers a non-leading dimension into a buffer of its own layout). XLA:CPU
  keeps to that; XLA:GPU still forms each new stack whole, one at a time under ZeRO-2, all of
  them under ZeRO-1 (memory/estimate.py:gathered_new_weights)."""
  def one(path, p, u):
    per_layer = (layer_writes or {}).get(jax.tree_util.keystr(path))
    if per_layer is None:
      return optax.apply_updates(p, fit(u, p.shape))

    def write(layer, p):
      new = p[layer] + fit(u[layer], p.shape[1:])
      new = jax.lax.with_sharding_constraint(new.astype(p.dtype), per_layer)
      return jax.lax.dynamic_update_index_in_dim(p, new, layer, 0)
    return jax.lax.fori_loop(0, p.shape[0], write, p)
  return jax.tree_util.tree_map_with_path(one, params, updates)


def updated_if_finite(finite: jax.Array, update, state):
  """`update(state)` where `finite`, else `state` itself, in place on either compiler
  (parallel/in_place.py). An elementwise select instead holds the new state beside the old: on
  XLA:CPU ZeRO-1/2's layer-by-layer writes are no longer made in place (bench.figures 67.6 ->
  81.0 MB for configs/zero1.py), and XLA:GPU gathers ZeRO-1/2's new weights whole (1b ZeRO-2 on 8
  H100s: 11.86 GB a device against 9.21) and lays 8-bit moments' codes out again (100m DDP: 1.284
  against 1.114 GB). A `lax.cond` copies the new state out of its branch on jax 0.10.2's XLA:GPU
  (7b ZeRO-3 on 8 H100s: 21.98 GiB against 16.36)."""
  return when(finite, update, state)


@dataclasses.dataclass(frozen=True)
class PerDevice:
  """Gradients taken per data-parallel device and summed there over the microbatches, reduced once
  per step (what PyTorch DDP's no_sync does): for layouts whose gradients are replicated over the
  data-parallel axes (DDP, ZeRO-1) with several microbatches (of the accumulation, or of a
  pipeline). Each microbatch's gradient is vmapped over the devices' rows, the mapped axis laid on
  the data-parallel mesh axes."""
  mesh: Mesh
  axes: tuple[str, ...]   # the data-parallel mesh axes
  rules: tuple            # the activation rules inside, where the batch is one device's rows

  @property
  def ways(self) -> int:
    return math.prod(self.mesh.shape[a] for a in self.axes)

  def partial_sums(self, grad_shardings):
    """Where the accumulator of one partial sum per device lives: [ways, *gradient], split over
    the data-parallel axes."""
    return jax.tree.map(
        lambda s: NamedSharding(self.mesh, PartitionSpec(self.axes, *s.spec)), grad_shardings)


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """What one train step is made of; `train_step(plan, state, batch)` runs it.

  `layout`: the train state's layout (train/state.py:StateLayout), whose facts the step follows:
  where gradients live (`grad_shardings`: sharded over `fsdp` from ZeRO-2 up, the data-parallel sum
  becomes a reduce-scatter once per microbatch, as DeepSpeed does at these stages), where the
  optimizer's updates are formed (`update_shardings`: beside its state, from ZeRO-1 up, so under
  ZeRO-1/2 only the new weights' dtype is gathered), the stacked weights written one layer at a
  time (`layer_writes`), and the shapes the state pads (`model_shapes`: the model gets the true
  ones inside the loss, so the padding's gradient is zero; `update_shapes`: what the optimizer
  pads to). None: one device's defaults, nothing constrained or padded.

  `per_device`: see PerDevice (None: gradients reduced as XLA places them). `dropout_seed`: LoRA
  dropout, a key per step, microbatch and device drawn from it (None: no dropout). `stack`: how
  the blocks run (parallel/pipeline.py; None: one after another). `offload`: the optimizer's
  state lives in host memory and the update streams it a layer at a time
  (train/offload.py:OffloadedOptimizer); None: the update runs on the device in one piece."""
  graphdef: Any
  tx: optax.GradientTransformation
  policy: Policy
  microbatches: int
  layout: Any = None
  per_device: PerDevice | None = None
  dropout_seed: int | None = None
  stack: Any = None
  offload: Any = None

  def fact(self, name: str):
    """One fact of the state's layout (None without a layout)."""
    return None if self.layout is None else getattr(self.layout, name)

  def place(self, grads):
    """Gradients where the layout keeps them."""
    shardings = self.fact('grad_shardings')
    return grads if shardings is None else jax.lax.with_sharding_constraint(grads, shardings)

  def keep(self, grads):
    """The accumulator where it lives: per device, one partial sum each; else as `place`."""
    if self.per_device is None:
      return self.place(grads)
    shardings = self.per_device.partial_sums(self.fact('grad_shardings'))
    return jax.lax.with_sharding_constraint(grads, shardings)

  def pads_update(self, params) -> bool:
    """Whether the optimizer's state pads what the stored parameters do not (ZeRO-1/2 on an fsdp
    size that does not divide a dimension): its gradients and weights are padded for the update."""
    shapes = self.fact('update_shapes')
    return shapes is not None and Shapes.of(params) != shapes


def make_train_step(graphdef, tx: optax.GradientTransformation, policy: Policy, microbatches: int,
                    **parts):
  """The step of a StepPlan (its fields by name), a function of (state, batch) to jit."""
  return functools.partial(train_step, StepPlan(graphdef, tx, policy, microbatches, **parts))


def train_step(plan: StepPlan, state: dict, batch: dict):
  """One optimizer step, in the order of the module docstring."""
  policy = plan.policy
  histories = _histories(state['params'])
  scale = state['loss_scale']['scale'] if policy.loss_scaling else jnp.float32(1.0)
  grads, loss = accumulated_gradients(plan, state, batch, scale, histories)
  # Back in each gradient's own dtype: an fp32 divisor would promote bf16 gradients (and with them
  # Adam's moments), and the new state could not reuse the donated buffers.
  if policy.loss_scaling:
    grads = jax.tree.map(lambda g, history: g if history else (g / scale).astype(g.dtype),
                         grads, histories)
  # In fp32 (16-bit gradients' squares would be summed in 16 bits), histories left out.
  grad_norm = optax.tree.norm(jax.tree.map(
      lambda g, history: jnp.zeros([]) if history else g.astype(jnp.float32), grads, histories))
  # An inf or nan anywhere in the gradients makes their norm non-finite: one scalar decides
  # whether the update happens. A skipped step leaves parameters and optimizer state as they
  # were (so no non-finite value ever enters the state); the step counter moves on with the data.
  # optax.apply_if_finite was considered and does not fit: after `max_consecutive_errors` bad
  # steps in a row it applies the non-finite update (ours never does: the loop stops the run at
  # train.max_bad_steps, train/loop.py); it judges the gradients alone (ours: the loss too, and
  # the norm already taken); fp16 loss scaling needs this same verdict and must not count
  # scaled overflows as bad steps; an offloaded optimizer (train/offload.py) updates outside
  # tx.update; and its ApplyIfFiniteState would wrap the optimizer state, so no checkpoint
  # saved so far would restore without a conversion.
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  update = functools.partial(updated, plan, state['params'], grads, grad_norm, finite)
  if plan.offload is None:
    new_state = updated_if_finite(finite, update, state)
  else:   # it keeps the old values where the step is not finite, layer by layer
    new_state = update(state)
  new_state = {**new_state, 'step': state['step'] + 1}
  metrics = {'loss': loss, 'grad_norm': grad_norm, 'skipped': jnp.logical_not(finite)}
  bad = jnp.logical_not(finite)
  if policy.loss_scaling:
    new_state['loss_scale'] = update_loss_scale(state['loss_scale'], finite)
    metrics['loss_scale'] = state['loss_scale']['scale']
    # Scaled gradients that overflow are loss scaling at work (the scale halves and the step is
    # retried on the next batch), not a bad step, unless the scale has nothing left to give.
    bad = jnp.logical_not(jnp.isfinite(loss)) | (
        bad & (state['loss_scale']['scale'] <= MIN_LOSS_SCALE))
  metrics['nonfinite'] = bad   # counted by the loop against train.max_bad_steps
  return new_state, metrics


def _histories(params):
  """True at each fp8 amax history: their updates are combined by their maximum (over
  microbatches and devices), start from -inf and are not divided: the batch's amax, whatever the
  layout (quant/fp8.py)."""
  return jax.tree_util.tree_map_with_path(lambda path, _: is_history(path), params)


def accumulated_gradients(plan: StepPlan, state: dict, batch: dict, scale, histories):
  """(gradient, loss) of the whole batch, still times `scale`: one scan over the microbatches,
  each microbatch's gradient added to the accumulator where the layout keeps it, and per device
  (`plan.per_device`) reduced once at the end."""
  params, per_device = state['params'], plan.per_device
  ways = 1 if per_device is None else per_device.ways
  lead = () if per_device is None else (ways,)   # the accumulators' leading per-device axis
  combine = lambda total, g, history: jnp.maximum(total, g) if history else total + g
  step_key = (None if plan.dropout_seed is None else
              jax.random.fold_in(jax.random.PRNGKey(plan.dropout_seed), state['step']))
  grad_fn = jax.value_and_grad(_scaled_loss(plan, state, batch, scale), has_aux=True)

  def microbatch_grads(microbatch, index):
    """(gradient, loss) of one microbatch; per device, [ways, ...] partial sums of both."""
    if per_device is None:
      key = None if step_key is None else jax.random.fold_in(step_key, index)
      (_, loss), grads = grad_fn(params, microbatch, key)
      return grads, loss
    rows = jax.tree.map(lambda x: x.reshape(ways, x.shape[0] // ways, *x.shape[1:]), microbatch)
    # Each device's rows get their own dropout masks.
    keys = (None if step_key is None else jax.vmap(
        lambda d: jax.random.fold_in(jax.random.fold_in(step_key, d), index))(jnp.arange(ways)))
    with linen.logical_axis_rules(per_device.rules):   # inside, the batch is one device's rows
      (_, losses), grads = jax.vmap(grad_fn, in_axes=(None, 0, None if keys is None else 0),
                                    spmd_axis_name=per_device.axes)(params, rows, keys)
    return grads, losses

  def accumulate(carry, inputs):
    grad_sum, loss_sum = carry
    grads, loss = microbatch_grads(*inputs)
    return (plan.keep(jax.tree.map(combine, grad_sum, plan.keep(grads), histories)),
            loss_sum + loss), None

  zeros = plan.keep(jax.tree.map(
      lambda p, history: jnp.full(lead + p.shape, -jnp.inf if history else 0, p.dtype),
      params, histories))
  (grad_sum, loss_sum), _ = jax.lax.scan(
      accumulate, (zeros, jnp.zeros(lead, jnp.float32)),
      (split_microbatches(batch, plan.microbatches), jnp.arange(plan.microbatches)))
  if per_device is not None:   # the one data-parallel reduction of the step
    reduce_devices = lambda g, history: g.max(0) if history else g.sum(0)
    return plan.place(jax.tree.map(reduce_devices, grad_sum, histories)), loss_sum.sum()
  if plan.pads_update(params):
    # Where the optimizer pads the gradients (parallel/padding.py), XLA otherwise gives the
    # accumulator's carry the optimizer's uneven layout and gathers its zeros whole, padded
    # (100m ZeRO-1 on 512 devices: 0.42 GiB more); elsewhere this constraint costs (7b ZeRO-1
    # on 8 devices: 0.43 GiB more), so it is only here.
    grad_sum = plan.place(grad_sum)
  return grad_sum, loss_sum


def _scaled_loss(plan: StepPlan, state: dict, batch: dict, scale):
  """loss(params, microbatch, dropout key) -> (loss times `scale`, loss).

  Every microbatch's (and device's) losses are divided by the whole batch's count of predicted
  targets: each is its share of the batch's mean, the gradients flowing back through the model
  are the whole batch's in every layout (fp8 delayed scaling records their amax), and their sum is
  the batch's gradient with nothing left to divide."""
  frozen, model_shapes = state.get('frozen', {}), plan.fact('model_shapes')
  batch_predicted = predicted(batch)
  # A pipeline that runs the backward pass in its loop (1f1b) must know the cotangent its loss
  # sum will get before it runs: the one autodiff passes it, bit for bit.
  stack = plan.stack
  if getattr(stack, 'runs_loss', False):
    stack = stack.seeded(scale / loss_denominator(batch, batch_predicted))

  def scaled_loss(p, microbatch, key):
    if model_shapes is not None:   # the model's shapes; the padding's gradient is zero
      p, base = model_shapes[0].fit(p), model_shapes[1].fit(frozen)
    else:
      base = frozen
    loss = cross_entropy(plan.graphdef, p, base, microbatch, key, stack, batch_predicted)
    return loss * scale, loss
  return scaled_loss


@jax.named_scope('optimizer')
def updated(plan: StepPlan, params, grads, grad_norm, finite, state: dict) -> dict:
  """`state` after the optimizer's update of `params` by `grads` (judged by `finite` here only
  where offloaded; else by the caller)."""
  # The learning rate is the schedule of the train step, skipped steps included.
  opt_state = schedule_at(state['opt_state'], state['step'])
  if plan.offload is not None:
    new_params, opt_state = plan.offload.update(grads, opt_state, params, grad_norm, finite)
    return {**state, 'params': new_params, 'opt_state': opt_state}
  update_grads, padded = grads, lambda tree: tree
  update_shardings = plan.fact('update_shardings')
  if plan.pads_update(params):
    # Split to the optimizer's layout at their true shape, so that padding them is local
    # (the accumulator's constraint needs this one too).
    update_grads = jax.lax.with_sharding_constraint(grads, update_shardings)
    padded = plan.layout.update_shapes.fit
  updates, opt_state = plan.tx.update(padded(update_grads), opt_state, padded(params))
  if update_shardings is not None:
    updates = jax.lax.with_sharding_constraint(updates, update_shardings)
  return {**state, 'params': apply_updates(params, updates, plan.fact('layer_writes')),
          'opt_state': opt_state}
