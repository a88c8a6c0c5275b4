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

  compiled = held_back.lower(new, jnp.float32(1)).compile(compiler_options={})   # as collectives'
  assert compiled.as_text().startswith('HloModule jit_train_step')   # the program keeps its name
  assert compiled.memory_analysis() is not None
  again, total = compiled(new, jnp.float32(1))
  np.testing.assert_array_equal(again['a'], np.full(4, 3.0))
  assert float(total) == 8.0 and new['b'].is_deleted() and not new['a'].is_deleted()


def test_an_offloaded_step_held_back_trains_as_the_one_donated_whole(monkeypatch):
  """The step of a tiny offloaded config (fp8 with delayed scaling, whose optimizer state has
  masked leaves) with its layer stacks held back, as on a GPU, against the CPU's step donated
  whole: the same losses and new state, bit for bit (the same program but for its arguments)."""
  from tests.helpers import random_tokens, tiny_config
  from train import run
  config = tiny_config(**{'precision': 'bf16_master', 'parallel.offload_optimizer': True,
                          'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed',
                          'mesh.data': 1, 'mesh.fsdp': 2, 'parallel.zero_stage': 3,
                          'data.packing': False})
  whole = run.setup(config, jax.devices()[:2])
  monkeypatch.setattr(run, 'holds_back', lambda platform: True)
  held = run.setup(config, jax.devices()[:2])
  assert isinstance(held.train_step, HeldBack) and not isinstance(whole.train_step, HeldBack)
  batch = {'inputs': random_tokens((8, 64)), 'targets': random_tokens((8, 64), seed=1)}
  results = []
  for s in (whole, held):
    state, losses = s.layout.init(), []
    compiled = run.compile_train_step(s)
    with s.context():
      for _ in range(2):
        state, metrics = compiled(state, jax.device_put(batch, s.batch_sharding))
        losses.append(float(metrics['loss']))
    results.append((losses, jax.device_get(state)))
  assert results[0][0] == results[1][0]
  for a, b in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
    np.testing.assert_array_equal(a, b)
