"""bf16 weights with an fp32 master copy in the optimizer state (precision=bf16_master,
optim/master.py): what is stored in which dtype, that it follows bf16_mixed from the same weights,
its model state per device against the ZeRO paper's formulas, bf16 gathers, and checkpoints that
move between meshes with the master intact."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.layouts import model_state_bytes, zero_formula
from memory.compiled import compiled_memory
from optim.master import master_weights
from parallel.collectives import partitioned_collectives
from tests.test_layouts import batches, config_for
from train import run
from tests.helpers import checkpoint_round_trip


def train(s, state, steps=3):
  losses = []
  for batch in list(batches(steps, rows=s.config.train.batch_size)):
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    losses.append(float(metrics['loss']))
  return state, losses


def bf16_ulp(x: np.ndarray) -> np.ndarray:
  """The spacing of bf16 at |x| (8 significant bits)."""
  exponent = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-126)))
  return 2.0 ** (exponent - 7)


def test_weights_are_bf16_and_the_master_and_moments_fp32_and_the_weights_round_the_master():
  s = run.setup(config_for('ddp', precision='bf16_master'), jax.devices()[:1])
  state, losses = train(s, s.layout.init())
  assert np.all(np.isfinite(losses))
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {jnp.dtype(jnp.bfloat16)}
  master = master_weights(state['opt_state'])
  assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
  moments = [x for x in jax.tree.leaves(state['opt_state']['inner'] if isinstance(
      state['opt_state'], dict) else state['opt_state'].inner) if x.ndim > 0]
  assert moments and {x.dtype for x in moments} == {jnp.dtype(jnp.float32)}
  # Each stored weight is its master rounded to bf16: exactly, or where an fp32 rounding of the
  # step (a weight that crossed zero or halved, optim/master.py) met a bf16 tie, one spacing off.
  exact = total = 0
  for w, m in zip(jax.tree.leaves(state['params']), jax.tree.leaves(master)):
    w, m = np.asarray(w, np.float32), np.asarray(m)
    rounded = np.asarray(jnp.asarray(m).astype(jnp.bfloat16), np.float32)
    assert np.all(np.abs(w - rounded) <= bf16_ulp(m))
    exact, total = exact + (w == rounded).sum(), total + w.size
  assert exact >= 0.9999 * total
  # and the master moved: Adam runs on it, not on the rounded weights
  start = master_weights(s.layout.init()['opt_state'])
  moved = [np.abs(np.asarray(a) - np.asarray(b)).max() for a, b in
           zip(jax.tree.leaves(master), jax.tree.leaves(start))]
  assert max(moved) > 0


def test_from_the_same_weights_it_trains_like_bf16_mixed():
  """bf16_mixed keeps fp32 weights and multiplies their bf16 rounding; bf16_master keeps the
  rounding and an fp32 master. From bf16-representable weights both forward passes are the same
  and Adam runs in fp32 on the same values; they differ by the bf16 rounding of the stored
  gradients (bf16_mixed's are fp32), which Adam's normalised step shrinks to a small fraction of
  the learning rate."""
  mixed = run.setup(config_for('ddp', precision='bf16_mixed'), jax.devices()[:1])
  master = run.setup(config_for('ddp', precision='bf16_master'), jax.devices()[:1])
  start = mixed.layout.init()
  weights = jax.tree.map(lambda w: w.astype(jnp.bfloat16), start['params'])
  mixed_state, mixed_losses = train(mixed, {**start, 'params': jax.tree.map(
      lambda w: w.astype(jnp.float32), weights)})
  fresh = master.layout.init()
  opt_state = fresh['opt_state']._replace(master=jax.tree.map(lambda w: w.astype(jnp.float32),
                                                              weights))
  master_state, master_losses = train(master, {**fresh, 'params': weights, 'opt_state': opt_state})
  assert master_losses[0] == mixed_losses[0]   # the same forward pass
  np.testing.assert_allclose(master_losses, mixed_losses, rtol=2.0**-8)
  lr = mixed.config.train.learning_rate
  for a, b in zip(jax.tree.leaves(master_weights(master_state['opt_state'])),
                  jax.tree.leaves(mixed_state['params'])):
    diff = np.abs(np.asarray(a) - np.asarray(b))
    assert diff.max() <= 3 * lr   # three steps: never more than the steps themselves
    assert np.mean(diff <= 0.1 * lr) >= 0.99


def test_model_state_per_device_is_the_zero_papers_and_zero3_gathers_bf16():
  """2 + 2 + 12 bytes per parameter: DDP 16, ZeRO-1 4 + 12/N, ZeRO-2 2 + 14/N, ZeRO-3 16/N, from
  the compiled arguments plus the gradients at their sharding (bench/layouts.py); within 5 %.
  ZeRO-3 gathers the weights in bf16: at most 0.55x the bytes fp32 weights are gathered in."""
  gathered = {}
  for layout in ('ddp', 'zero1', 'zero2', 'fsdp'):
    s = run.setup(config_for(layout, precision='bf16_master', **{'model.remat': 'full'}))
    lowered = run.lower_train_step(s)
    with s.context():
      compiled = lowered.compile()
    psi = s.model.num_params
    state = model_state_bytes(s, compiled_memory(compiled)['arguments'])
    np.testing.assert_allclose(state, zero_formula(layout, psi, 8), rtol=0.05)
    if layout == 'fsdp':
      with s.context():
        gathered['bf16_master'] = partitioned_collectives(lowered, 8)['all-gather']['bytes']
  s = run.setup(config_for('fsdp', precision='fp32', **{'model.remat': 'full'}))
  gathered['fp32'] = partitioned_collectives(run.lower_train_step(s), 8)['all-gather']['bytes']
  assert 0 < gathered['bf16_master'] <= 0.55 * gathered['fp32']


def test_a_checkpoint_moves_between_zero3_and_one_device_with_the_master_intact(tmp_path):
  sharded = run.setup(config_for('fsdp', precision='bf16_master'))
  single = run.setup(config_for('ddp', precision='bf16_master'), jax.devices()[:1])
  state, _ = train(sharded, sharded.layout.init(), steps=2)
  restored, saved = checkpoint_round_trip(state, 2, single.layout.abstract, str(tmp_path / 'c'))
  for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(got, want)
  # and training goes on from it on the new mesh as it would have on the old one
  _, on_one = train(single, restored, steps=1)
  _, on_eight = train(sharded, jax.device_put(saved, sharded.layout.shardings), steps=1)
  np.testing.assert_allclose(on_one, on_eight, rtol=2.0**-8)


@pytest.mark.parametrize('overrides', [
    {'quant.adam_bits': 8, 'train.microbatches': 2, 'train.batch_size': 16}, {'lora.rank': 2}])
def test_it_composes_with_8bit_adam_lora_and_microbatches(overrides):
  s = run.setup(config_for('fsdp', precision='bf16_master', **overrides))
  state, losses = train(s, s.layout.init(), steps=2)
  assert np.all(np.isfinite(losses))
  master = master_weights(state['opt_state'])
  assert {x.dtype for x in jax.tree.leaves(master)} == {jnp.dtype(jnp.float32)}
  assert {x.dtype for x in jax.tree.leaves(state['params'])} == {jnp.dtype(jnp.bfloat16)}
