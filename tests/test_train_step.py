"""The train step: learning, gradient accumulation, mixed precision and fp16 loss scaling."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim.adamw import learning_rate_schedule, make_optimizer
from parallel.mesh import make_mesh
from parallel.rules import layout_rules
from tests.helpers import random_tokens, reordered_rtol, split_params, tiny_config, tiny_model
from train import checks
from train.state import state_layout
from train.step import cross_entropy, make_train_step


def make(config, devices=1, adam_bits=32):
  spec = checks.model_spec(config)
  mesh = make_mesh({'data': devices}, jax.devices()[:devices])
  tx = make_optimizer(config.train, adam_bits)
  layout = state_layout(spec, tx, mesh, layout_rules(0))
  step = jax.jit(make_train_step(layout.graphdef, tx, spec.policy, config.train.microbatches))
  return layout, step


def batch_of(rows, seq_len=32, seed=0):
  tokens = random_tokens((rows, seq_len + 1), seed)
  # A learnable pattern: each sequence repeats a short random motif.
  tokens = np.tile(tokens[:, :8], (1, (seq_len + 8) // 8))[:, :seq_len + 1]
  return {'inputs': jnp.asarray(tokens[:, :-1]), 'targets': jnp.asarray(tokens[:, 1:])}


def test_loss_falls_over_a_few_dozen_steps():
  layout, step = make(tiny_config(**{'train.steps': 40, 'train.learning_rate': 3e-3}))
  state, losses = layout.init(), []
  for i in range(40):
    state, metrics = step(state, batch_of(8, seed=i % 4))
    losses.append(float(metrics['loss']))
  assert np.mean(losses[-5:]) < 0.75 * np.mean(losses[:5]), losses


def test_k_microbatches_equal_one_batch_of_k_times_the_size():
  batch = batch_of(8)
  one_layout, one_step = make(tiny_config(**{'train.microbatches': 1}))
  acc_layout, acc_step = make(tiny_config(**{'train.microbatches': 4}))
  start = one_layout.init()
  grads = jax.jit(jax.grad(cross_entropy, argnums=1), static_argnums=0)(
      one_layout.graphdef, start['params'], {}, batch)
  one_state, one_metrics = one_step(start, batch)
  acc_state, acc_metrics = acc_step(acc_layout.init(), batch)
  # The loss is a mean over the batch's tokens and each gradient a sum over them: in microbatches,
  # added in another order.
  tokens = batch['inputs'].size
  np.testing.assert_allclose(one_metrics['loss'], acc_metrics['loss'], rtol=reordered_rtol(tokens))
  np.testing.assert_allclose(one_metrics['grad_norm'], acc_metrics['grad_norm'],
                             rtol=reordered_rtol(tokens))
  # Adam's first update is lr g / (|g| + eps), g clipped to norm 1 (eps = 1e-8): a rounding dg of g
  # moves it by lr eps dg / (|g| + eps)^2, up to 2 lr where g (nearly) cancels to ~eps, but under
  # 1e-4 lr dg / eps where |g| > 100 eps. There the weights agree to ulps (atol: 1e-4 lr, dg <= eps),
  # and that must be nearly every weight.
  clipped = max(1.0, float(one_metrics['grad_norm']))
  settled = [np.abs(np.asarray(g)) / clipped > 100 * 1e-8 for g in jax.tree.leaves(grads)]
  assert sum(m.sum() for m in settled) > 0.99 * sum(m.size for m in settled)
  for keep, a, b in zip(settled, jax.tree.leaves(one_state['params']),
                        jax.tree.leaves(acc_state['params'])):
    np.testing.assert_allclose(np.asarray(a)[keep], np.asarray(b)[keep], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('precision', ['bf16_mixed', 'fp16'])
def test_mixed_precision_keeps_fp32_master_weights_and_optimizer_state(precision):
  layout, step = make(tiny_config(precision=precision))
  state, metrics = step(layout.init(), batch_of(8))
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {jnp.dtype(jnp.float32)}
  moments = [x for x in jax.tree.leaves(state['opt_state']) if x.ndim > 0]
  assert {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  assert np.isfinite(metrics['loss'])


@pytest.mark.parametrize('precision, low, high', [
    # fp32 arithmetic: unit roundoff 2**-24, a few hundred terms per dot: far below 2**-16.
    ('fp32', 0.0, 2.0**-16),
    # bf16 operands: unit roundoff 2**-9 on every weight and activation, so the logits move by
    # ~2**-9 of their size (a few times that over the layers), never by less than 2**-12.
    ('bf16_mixed', 2.0**-12, 2.0**-4)])
def test_logits_have_the_precision_of_their_compute_dtype(precision, low, high):
  """Same weights; the logits' RMS error against an fp32 reference at the highest matmul precision,
  relative to their RMS: the band of each format excludes the other's."""
  tokens = jnp.asarray(random_tokens((4, 32)))
  _, reference_model = tiny_model('fp32')
  _, model = tiny_model(precision)
  for a, b in zip(jax.tree.leaves(split_params(reference_model)[1]),
                  jax.tree.leaves(split_params(model)[1])):
    np.testing.assert_array_equal(a, b)   # the same fp32 weights: only the compute differs
  with jax.default_matmul_precision('highest'):
    reference = np.asarray(reference_model(tokens), np.float64)
  logits = np.asarray(model(tokens), np.float64)
  error = np.sqrt(np.mean((logits - reference) ** 2)) / np.sqrt(np.mean(reference ** 2))
  assert low <= error <= high, error


def test_pure_bf16_stores_weights_in_bf16():
  layout, step = make(tiny_config(precision='bf16'))
  state, _ = step(layout.init(), batch_of(8))
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {jnp.dtype(jnp.bfloat16)}


def test_fp16_overflow_skips_the_step_and_halves_the_scale():
  layout, step = make(tiny_config(precision='fp16'))
  state = layout.init()
  # A scale this large overflows fp16 activations' gradients (max ~65504) to inf.
  state['loss_scale'] = {'scale': jnp.asarray(2.0**40, jnp.float32),
                         'good_steps': jnp.asarray(5, jnp.int32)}
  before = jax.tree.map(np.asarray, state)
  after, metrics = step(state, batch_of(8))
  assert bool(metrics['skipped'])
  assert not bool(metrics['nonfinite'])   # loss scaling at work, not a diverged run
  for a, b in zip(jax.tree.leaves(before['params']), jax.tree.leaves(after['params'])):
    np.testing.assert_array_equal(a, b)
  for a, b in zip(jax.tree.leaves(before['opt_state']), jax.tree.leaves(after['opt_state'])):
    np.testing.assert_array_equal(a, b)
  assert float(after['loss_scale']['scale']) == 2.0**39
  assert int(after['loss_scale']['good_steps']) == 0


def test_fp16_overflow_at_the_smallest_scale_is_a_bad_step():
  layout, step = make(tiny_config(precision='fp16'))
  state = layout.init()
  state['loss_scale'] = {'scale': jnp.asarray(1.0, jnp.float32), 'good_steps': jnp.asarray(0, jnp.int32)}
  state['params']['embedding'] = state['params']['embedding'].at[0, 0].set(jnp.inf)
  _, metrics = step(state, batch_of(8))
  assert bool(metrics['skipped']) and bool(metrics['nonfinite'])


@pytest.mark.parametrize('precision', ['fp32', 'bf16_mixed'])
def test_a_non_finite_gradient_leaves_every_piece_of_state_unchanged(precision):
  layout, step = make(tiny_config(precision=precision))
  state, _ = step(layout.init(), batch_of(8, seed=1))   # Adam's moments no longer zero
  batch = batch_of(8)
  # One inf weight in the last layer's MLP: the loss may stay finite, its gradient does not.
  down = state['params']['blocks']['mlp']['down']['kernel']
  state['params']['blocks']['mlp']['down']['kernel'] = down.at[-1, 0, 0].set(jnp.inf)
  before = jax.tree.map(np.asarray, state)
  after, metrics = step(state, batch)
  assert bool(metrics['skipped']) and bool(metrics['nonfinite'])
  assert int(after['step']) == int(before['step']) + 1   # the data position moves on
  for part in ('params', 'opt_state', 'loss_scale'):
    for a, b in zip(jax.tree.leaves(before[part]), jax.tree.leaves(after[part])):
      np.testing.assert_array_equal(a, b)


def test_a_skipped_update_hands_back_the_old_state_bit_for_bit():
  """A non-finite step is skipped by parallel/in_place.py's `when` (train/step.py:
  updated_if_finite): the old values come back exactly, a negative zero's sign too, whatever the
  new ones hold."""
  from parallel.in_place import when
  old = {'w': jnp.array([1.5, -0.0, 3.0], jnp.bfloat16), 'count': jnp.array(7, jnp.int32)}
  new = {'w': jnp.array([jnp.nan, jnp.inf, 2.0], jnp.bfloat16), 'count': jnp.array(8, jnp.int32)}
  step = jax.jit(lambda finite, state: when(finite, lambda _: new, state))
  kept = step(jnp.array(False), old)
  for a, b in zip(jax.tree.leaves(kept), jax.tree.leaves(old)):
    np.testing.assert_array_equal(np.atleast_1d(a).view(np.uint8), np.atleast_1d(b).view(np.uint8))
  taken = step(jnp.array(True), old)
  np.testing.assert_array_equal(np.asarray(taken['w'], np.float32), [np.nan, np.inf, 2.0])
  assert int(taken['count']) == 8


@pytest.mark.parametrize('adam_bits', [32, 8])
def test_skipped_steps_count_in_the_learning_rate_schedule(adam_bits):
  """Steps 0-3 skipped (a non-finite gradient), step 4 applied: its rate is the schedule's at train
  step 4, not at 0 (optax's own count stops on a skipped update). Adam's first applied update is
  lr g / (|g| + eps), lr in magnitude wherever |g| >> eps; the norms' scales are not decayed, and
  are small enough to keep 32-bit moments under 8-bit Adam too."""
  config = tiny_config(**{'train.steps': 40, 'train.warmup_steps': 10, 'train.learning_rate': 1e-2})
  layout, step = make(config, adam_bits=adam_bits)
  state, batch, skips = layout.init(), batch_of(8), 4
  finite = state['params']['blocks']['mlp']['down']['kernel']
  for _ in range(skips):
    state['params']['blocks']['mlp']['down']['kernel'] = finite.at[-1, 0, 0].set(jnp.inf)
    state, metrics = step(state, batch)
    assert bool(metrics['skipped'])
    state['params']['blocks']['mlp']['down']['kernel'] = finite
  before = np.asarray(state['params']['final_norm']['scale'])
  state, metrics = step(state, batch)
  assert not bool(metrics['skipped']) and int(state['step']) == skips + 1
  moved = np.abs(np.asarray(state['params']['final_norm']['scale']) - before)
  schedule = learning_rate_schedule(config.train)
  assert float(schedule(skips)) > 4 * float(schedule(0))   # in the warmup: far apart
  # Never more than lr (up to rounding a weight near 1: 2 fp32 ulps); lr within rounding where |g|
  # dwarfs eps, as for most of them.
  lr = float(schedule(skips))
  assert moved.max() <= lr + 2 * np.finfo(np.float32).eps
  np.testing.assert_allclose(np.median(moved), lr, rtol=1e-4)


def test_fp16_finite_step_updates_and_counts_towards_growth():
  layout, step = make(tiny_config(precision='fp16'))
  state = layout.init()
  before = jax.tree.map(np.asarray, state['params'])
  after, metrics = step(state, batch_of(8))
  assert not bool(metrics['skipped'])
  assert not all(np.array_equal(a, b) for a, b in
                 zip(jax.tree.leaves(before), jax.tree.leaves(after['params'])))
  assert int(after['loss_scale']['good_steps']) == 1
  assert float(after['loss_scale']['scale']) == 2.0**15


@pytest.mark.parametrize('microbatches', [1, 2])
def test_data_parallel_steps_match_one_device(microbatches):
  """The run's own sharded, donated step on 8 devices against an unsharded one-device step."""
  from train import run
  config = tiny_config(**{'train.batch_size': 16, 'train.microbatches': microbatches})
  s = run.setup(config)
  assert s.mesh.shape['data'] == 8
  one_layout, one_step = make(config)
  dp_state, one_state = s.layout.init(), one_layout.init()
  for i in range(3):
    batch = batch_of(16, seed=i)
    with s.context():
      dp_state, dp = s.train_step(dp_state, {k: jax.device_put(v, s.batch_sharding)
                                             for k, v in batch.items()})
    one_state, one = one_step(one_state, batch)
    # A mean over the batch's tokens, summed per device (and microbatch) and across them.
    np.testing.assert_allclose(one['loss'], dp['loss'], rtol=reordered_rtol(batch['inputs'].size))
  assert dp_state['params']['embedding'].sharding.is_fully_replicated


def test_weight_decay_is_chosen_by_name():
  """Kernels, embedding and position tables and LoRA factors decay; biases (GPT-2's query bias is a
  [heads, head_dim] matrix), norm scales and norm biases do not, whatever their rank."""
  from flax import traverse_util
  from optim.decay import weight_decay_mask
  layout, _ = make(tiny_config(**{'model.norm': 'layer', 'model.bias': True,
                                  'model.positions': 'learned', 'model.mlp': 'gelu',
                                  'model.tie_embeddings': False}))
  mask = traverse_util.flatten_dict(weight_decay_mask(layout.abstract['params']), sep='/')
  decayed = {path for path, decays in mask.items() if decays}
  assert decayed == {path for path in mask if path.rsplit('/', 1)[-1] in ('kernel', 'embedding',
                                                                         'positions')}
  assert mask['blocks/attention/query/bias'] is False
  assert layout.abstract['params']['blocks']['attention']['query']['bias'].ndim == 3
  assert mask['blocks/mlp_norm/bias'] is False and mask['final_norm/scale'] is False
  assert mask['positions'] is True and mask['head/kernel'] is True
  lora = traverse_util.flatten_dict(weight_decay_mask(
      make(tiny_config(**{'lora.rank': 2}))[0].abstract['params']), sep='/')
  assert lora and all(lora.values()), lora
