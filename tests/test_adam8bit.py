"""8-bit Adam: the code books, the block-wise round trip, tracking fp32 Adam, and its bytes."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from optim.adam8bit import scale_by_adam_8bit
from parallel.collectives import collective_stats
from quant.blockwise import dequantize_blockwise, dynamic_code, quantize_blockwise, zero_blocks
from tests.helpers import tiny_config
from train import checks, run


@pytest.mark.parametrize('signed', [True, False])
def test_code_books_have_256_sorted_distinct_values_spanning_the_range(signed):
  code = dynamic_code(signed)
  assert code.size == 256 and len(np.unique(code)) == 256 and np.all(np.diff(code) > 0)
  assert code[-1] == 1.0 and 0.0 in code
  assert code[0] < -0.99 if signed else code[0] == 0.0
  assert np.min(np.abs(code[code != 0])) < 1e-6   # seven decades of range


@pytest.mark.parametrize('signed', [True, False])
def test_blockwise_round_trip_error_is_within_half_a_code_gap_of_each_block(signed):
  rng = np.random.default_rng(0)
  x = rng.standard_t(3, size=(37, 211)).astype(np.float32)   # heavy tails, ragged last block
  x = x if signed else np.abs(x)
  q = quantize_blockwise(jnp.asarray(x), 256, signed)
  y = np.asarray(dequantize_blockwise(q, x.shape, signed))
  code = dynamic_code(signed)
  # The signed code tops out at ~0.993 on the negative side: a value at -absmax may lose that.
  bound = np.max(np.diff(code)) / 2 + (1 + code[0] if signed else 0)
  scales = np.asarray(q['scale'])
  blocks = np.pad(np.abs(x - y).reshape(-1), (0, (-x.size) % 256)).reshape(-1, 256)
  assert np.all(blocks.max(axis=1) <= bound * scales + 1e-7)
  assert q['codes'].dtype == jnp.uint8


@pytest.mark.parametrize('signed', [True, False])
@pytest.mark.parametrize('shape, block_size', [((37, 211), 256), ((4096,), 2048), ((), 256)])
def test_fresh_moments_are_quantized_zeros(signed, shape, block_size):
  """The state's creation writes zero moments out rather than quantizing zeros (which XLA:GPU would
  fold at compile time): the same codes and scales, ragged last block included."""
  made = zero_blocks(shape, block_size, signed)
  quantized = quantize_blockwise(jnp.zeros(shape, jnp.float32), block_size, signed)
  for key in ('codes', 'scale'):
    assert made[key].dtype == quantized[key].dtype
    np.testing.assert_array_equal(made[key], quantized[key])


def test_small_tensors_keep_fp32_moments():
  state = scale_by_adam_8bit().init({'big': jnp.zeros((64, 128)), 'small': jnp.zeros((100,))})
  assert state.mu['small'].dtype == jnp.float32
  assert state.mu['big']['codes'].dtype == jnp.uint8 and state.mu['big']['codes'].shape == (4, 2048)


def test_eight_bit_adam_follows_fp32_adam_on_a_regression():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(256, 64)), jnp.float32)
  w_true = jnp.asarray(rng.normal(size=(64, 128)), jnp.float32)
  y = x @ w_true

  def fit(adam):
    tx = optax.chain(adam, optax.scale(-1e-2))
    params = {'w': jnp.zeros((64, 128))}
    state = tx.init(params)
    loss = lambda p: jnp.mean((x @ p['w'] - y) ** 2)

    @jax.jit
    def step(params, state):
      grads = jax.grad(loss)(params)
      updates, state = tx.update(grads, state, params)
      return optax.apply_updates(params, updates), state

    losses = []
    for _ in range(300):
      params, state = step(params, state)
      losses.append(float(loss(params)))
    return np.asarray(losses), params

  fp32_losses, fp32_params = fit(optax.scale_by_adam())
  q_losses, q_params = fit(scale_by_adam_8bit(block_size=256))
  assert q_losses[-1] < 0.05 * q_losses[0]                        # it learns
  # Stated tolerance: within 10 % of fp32 Adam's loss all along the last 100 steps, and weights
  # within 5 % (relative norm of the difference).
  np.testing.assert_allclose(q_losses[-100:], fp32_losses[-100:], rtol=0.10)
  diff = np.linalg.norm(q_params['w'] - fp32_params['w']) / np.linalg.norm(fp32_params['w'])
  assert diff < 0.05


def arguments_bytes(**overrides):
  config = tiny_config(**{'model.d_model': 128, 'model.mlp_dim': 512, 'train.batch_size': 8,
                          **overrides})
  s = run.setup(config, jax.devices()[:1])
  memory = run.memory_report(s, run.compile_train_step(s))
  return memory['per_device_bytes']['arguments'], memory['num_params']


def test_compiled_optimizer_state_is_at_most_30_percent_of_fp32_adam():
  fp32_args, n = arguments_bytes(**{'mesh.data': 1})
  q_args, _ = arguments_bytes(**{'mesh.data': 1, 'quant.adam_bits': 8})
  params_bytes = 4 * n
  fp32_state, q_state = fp32_args - params_bytes, q_args - params_bytes
  assert q_state <= 0.30 * fp32_state, (q_state, fp32_state)


def test_eight_bit_moments_shard_their_blocks_under_zero3_and_train():
  config = tiny_config(**{'quant.adam_bits': 8, 'quant.adam_block_size': 256, 'mesh.data': 1,
                          'mesh.fsdp': 8, 'parallel.zero_stage': 3, 'model.d_model': 128,
                          'model.mlp_dim': 512})
  s = run.setup(config)
  state = s.layout.init()
  codes = state['opt_state'][1][0].mu['blocks']['mlp']['gate']['kernel']['codes']
  assert 'fsdp' in codes.sharding.spec[0]
  assert codes.addressable_shards[0].data.shape[0] == codes.shape[0] // 8
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(3):
    tokens = rng.integers(0, 256, (8, 65), np.int32)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding) for k, v in batch.items()})
    losses.append(float(metrics['loss']))
  assert all(np.isfinite(losses))
  # Blocked from the sharded (embed) dimension, each device's slice is whole blocks: the step moves
  # no gradients into blocks across devices (before, every step had all-to-alls for this).
  collectives = collective_stats(run.compile_train_step(s).as_text(), 8)
  assert collectives['all-to-all']['count'] == 0


@pytest.mark.parametrize('overrides, message', [
    ({'quant.adam_bits': 4}, 'quant.adam_bits=4; allowed: 32, 8'),
    ({'quant.adam_block_size': 1000}, 'quant.adam_block_size=1000; allowed: 256, 2048'),
])
def test_bad_eight_bit_settings_are_refused(overrides, message):
  with pytest.raises(checks.ConfigError, match=message):
    run.setup(tiny_config(**overrides))


def test_the_fused_update_equals_the_optax_chain_it_replaces():
  """adamw_8bit runs clipping, Adam, weight decay and the learning rate inside its slice loop; its
  state is the unfused chain's (checkpoints restore either way) and its updates equal the chain's
  up to fp32 rounding (the clip factor applied as one multiply instead of a divide and a multiply),
  with the clip triggered (step 1) and not."""
  import optax
  from optim.adam8bit import adamw_8bit
  from optim.decay import weight_decay_mask
  schedule = optax.linear_schedule(1e-3, 1e-4, 10)
  params = {'kernel': jax.random.normal(jax.random.key(0), (64, 256)), 'scale': jnp.ones((64,)),
            'embedding': jax.random.normal(jax.random.key(1), (300, 64))}
  fused = adamw_8bit(schedule, 0.9, 0.95, 0.1, weight_decay_mask, max_grad_norm=1.0,
                     block_size=256)
  chain = optax.chain(optax.clip_by_global_norm(1.0), optax.chain(
      scale_by_adam_8bit(0.9, 0.95, 1e-8, 256), optax.add_decayed_weights(0.1, weight_decay_mask),
      optax.scale_by_learning_rate(schedule)))
  fused_state, chain_state = fused.init(params), chain.init(params)
  assert jax.tree.structure(fused_state) == jax.tree.structure(chain_state)
  for i in range(3):
    grads = jax.tree.map(lambda p: jax.random.normal(jax.random.key(10 + i), p.shape)
                         * (3.0 if i == 1 else 0.01), params)
    fused_updates, fused_state = jax.jit(fused.update)(grads, fused_state, params)
    chain_updates, chain_state = jax.jit(chain.update)(grads, chain_state, params)
    for a, b in zip(jax.tree.leaves(fused_updates), jax.tree.leaves(chain_updates)):
      np.testing.assert_allclose(a, b, rtol=2.0**-20, atol=2.0**-20 * float(jnp.abs(b).max()))
    for a, b in zip(jax.tree.leaves(fused_state), jax.tree.leaves(chain_state)):
      floating = jnp.issubdtype(a.dtype, jnp.floating) and a.ndim > 0   # fp32 moments, scales
      a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
      if floating:
        np.testing.assert_allclose(a, b, rtol=2.0**-18, atol=2.0**-20 * np.abs(b).max())
      else:   # 8-bit codes: a value on a code boundary may round either way; counts are equal
        assert np.abs(a - b).max() <= 1
