"""Host memory as a tier (`parallel.offload_optimizer`, `parallel.offload_frozen`,
`model.remat=offload|dots_offload`): the same training with and without it, the state where it is
promised (the compiled program's edge says which arguments live in host memory), checkpoints that
move between offloaded and not, and one line for what cannot run.

XLA:CPU keeps host and device memory in one RAM and drops placements inside a program, so the
numbers are the same program's; that the GPU program moves what it should is read off the step
lowered for CUDA (no GPU needed to lower)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from optim.master import master_weights
from tests.helpers import checkpoint_round_trip, reordered_rtol, tiny_config
from tests.test_layouts import config_for, train_from
from train import checks, run


OFFLOADED = 'pinned_host'


def _kinds(tree) -> set[str]:
  return {leaf.sharding.memory_kind for leaf in jax.tree.leaves(tree)}


def _trained(config, devices=None):
  s = run.setup(config, devices)
  state = s.layout.init()
  return s, state, train_from(s, state)


def _train(s, state, steps):
  from tests.test_layouts import batches
  losses = []
  for batch in list(batches(rows=s.config.train.batch_size))[:steps]:
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    losses.append(float(metrics['loss']))
  return state, losses


@pytest.mark.parametrize('layout,precision,update', [
    ('zero1', 'bf16_master', 'device'), ('zero2', 'fp32', 'device'),
    ('fsdp', 'bf16_master', 'device'), ('zero1', 'bf16_master', 'host'),
    ('fsdp', 'bf16_master', 'host')])
def test_the_offloaded_optimizer_trains_as_the_one_on_the_device(layout, precision, update):
  """Streamed through the device a layer at a time, or computed on the host where the state
  lives (parallel.offload_update): the same training as the optimizer on the device."""
  on_device = run.setup(config_for(layout, precision=precision))
  offloaded = run.setup(config_for(layout, precision=precision,
                                   **{'parallel.offload_optimizer': True,
                                      'parallel.offload_update': update}))
  assert _kinds(offloaded.layout.abstract['opt_state']) == {OFFLOADED}
  assert _kinds(offloaded.layout.abstract['params']) == {'device'}
  state_a, losses_a = _train(on_device, on_device.layout.init(), 3)
  state_b, losses_b = _train(offloaded, offloaded.layout.init(), 3)
  # The same arithmetic; clipping takes the step's norm of the gradients where optax takes its
  # own, the same sum possibly in another order (the update is then within one fp32 rounding).
  tokens = 8 * 16
  np.testing.assert_allclose(losses_b, losses_a, rtol=reordered_rtol(tokens))
  assert _kinds(state_b['opt_state']) == {OFFLOADED}
  n = sum(x.size for x in jax.tree.leaves(state_a['params']))
  for want, got in zip(jax.tree.leaves(jax.device_get(state_a['opt_state'])),
                       jax.tree.leaves(jax.device_get(state_b['opt_state']))):
    # A moment that sums gradients of both signs can be near 0 on either side: its error is
    # relative to the magnitudes summed, bounded by the leaf's largest.
    want = np.asarray(want, np.float64)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=reordered_rtol(n),
                               atol=reordered_rtol(n) * float(np.abs(want).max(initial=0)))


@pytest.mark.parametrize('update', ['device', 'host'])
def test_a_skipped_step_leaves_the_offloaded_state_as_it_was(update):
  s = run.setup(config_for('zero2', precision='bf16_master',
                           **{'parallel.offload_optimizer': True,
                              'parallel.offload_update': update}))
  state = s.layout.init()
  before = jax.tree.map(np.asarray, jax.device_get(state))
  # Gradients are not finite when the loss is not: a weight of inf makes every logit inf.
  params = jax.tree.map(lambda x: x, state['params'])
  params['embedding'] = jnp.full_like(params['embedding'], jnp.inf)
  state = {**state, 'params': params}
  before['params']['embedding'] = np.asarray(jax.device_get(params['embedding']))
  state, _ = _train(s, state, 1)
  after = jax.device_get(state)
  for want, got in zip(jax.tree.leaves(before['opt_state']), jax.tree.leaves(after['opt_state'])):
    np.testing.assert_array_equal(got, want)
  assert int(after['step']) == 1


def test_the_compiled_program_keeps_the_optimizer_state_in_host_memory():
  s = run.setup(config_for('fsdp', precision='bf16_master',
                           **{'parallel.offload_optimizer': True, 'model.remat': 'full'}))
  report = run.memory_report(s, run.compile_train_step(s))
  per_device = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(
      s.layout.abstract['opt_state'])) // 8   # every leaf of this model divides 8 ways (or is a scalar)
  host = report['host_bytes']
  assert abs(host['arguments'] - per_device) <= 8 * 4   # the scalar counts are whole on each device
  assert host['aliased'] == host['arguments']   # donated: updated in place
  assert host['per_host'] == 8 * host['total']
  estimated = report['estimate_host_bytes']['optimizer']
  assert abs(estimated - host['arguments']) <= 0.05 * host['arguments']


@pytest.mark.parametrize('offload_at', ['save', 'restore'])
def test_a_checkpoint_moves_between_offloaded_and_not_and_between_meshes(tmp_path, offload_at):
  saving = run.setup(config_for('fsdp', precision='bf16_master',
                                **{'parallel.offload_optimizer': offload_at == 'save'}))
  restoring = run.setup(config_for('ddp', precision='bf16_master',
                                   **{'parallel.offload_optimizer': offload_at == 'restore'}),
                        jax.devices()[:1])
  state, _ = _train(saving, saving.layout.init(), 2)
  restored, saved = checkpoint_round_trip(state, 2, restoring.layout.abstract, str(tmp_path / 'c'))
  assert _kinds(restored['opt_state']) == {OFFLOADED if offload_at == 'restore' else 'device'}
  for got, want in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(saved)):
    np.testing.assert_array_equal(got, want)
  assert master_weights(restored['opt_state']) is not None
  _, losses = _train(restoring, restored, 1)
  assert np.isfinite(losses).all()


def test_an_offloaded_frozen_base_trains_as_one_on_the_device():
  lora = {'lora.rank': 2, 'precision': 'bf16_mixed'}
  on_device = run.setup(config_for('fsdp', **lora))
  offloaded = run.setup(config_for('fsdp', **lora, **{'parallel.offload_frozen': True}))
  assert _kinds(offloaded.layout.abstract['frozen']) == {OFFLOADED}
  _, losses_a = _train(on_device, on_device.layout.init(), 3)
  _, losses_b = _train(offloaded, offloaded.layout.init(), 3)
  np.testing.assert_array_equal(losses_b, losses_a)   # the same program on XLA:CPU
  before = run.memory_report(on_device, run.compile_train_step(on_device))
  report = run.memory_report(offloaded, run.compile_train_step(offloaded))
  frozen = sum(leaf.size * leaf.dtype.itemsize
               for leaf in jax.tree.leaves(offloaded.layout.abstract['frozen']))
  host = report['host_bytes']['arguments']
  assert frozen / 8 <= host <= frozen   # sharded 8 ways, what does not divide whole
  # The device holds less (XLA:CPU keeps copies of some gathered host shards in its temp), and
  # the estimate counts the base where it lives.
  assert report['per_device_bytes']['total'] < before['per_device_bytes']['total']
  assert abs(report['estimate_host_bytes']['frozen'] - host) <= 0.05 * host


@pytest.mark.parametrize('offload,on_device', [('offload', 'full'), ('dots_offload', 'dots')])
def test_offloaded_activations_train_as_those_on_the_device(offload, on_device):
  _, _, want = _trained(config_for('fsdp', **{'model.remat': on_device}))
  _, _, got = _trained(config_for('fsdp', **{'model.remat': offload}))
  np.testing.assert_array_equal(got, want)   # the same program on XLA:CPU


def _gradient(remat: str):
  """(the loss of a tiny bf16_mixed model with `remat` as a function of its weights, weights)."""
  from tests.helpers import random_tokens, split_params, tiny_model
  from train.step import cross_entropy
  _, model = tiny_model('bf16_mixed', remat=remat, attention='xla')
  graphdef, params = split_params(model)
  tokens = random_tokens((3, 17))   # 3 rows: no dimension of the activations is the layer count
  batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
  return (lambda p: cross_entropy(graphdef, p, {}, batch)), params


def _saved_per_layer(remat: str) -> list[tuple[tuple[int, ...], str]]:
  """(shape, memory) of what the backward pass keeps from each layer (stacked by the scan)."""
  loss, params = _gradient(remat)
  layers = tiny_config().model.num_layers
  # The residuals are the leaves of the function jax.vjp returns.
  residuals = jax.make_jaxpr(lambda p: jax.tree.leaves(jax.vjp(loss, p)[1]))(params).out_avals
  return sorted((tuple(aval.shape), str(aval.memory_space)) for aval in residuals
                if aval.ndim > 2 and aval.shape[:2] == (layers, 3))


@pytest.mark.parametrize('offload,on_device', [('offload', 'full'), ('dots_offload', 'dots')])
def test_the_offload_policies_keep_in_host_memory_what_the_others_keep_on_the_device(
    offload, on_device):
  kept = _saved_per_layer(on_device)
  assert kept and {memory for _, memory in kept} == {'MemorySpace.Device'}
  assert _saved_per_layer(offload) == [(shape, 'MemorySpace.Host') for shape, _ in kept]


def test_the_gpu_program_moves_each_block_input_to_host_memory():
  import re
  loss, params = _gradient('offload')
  lowered = jax.jit(jax.grad(loss)).trace(params).lower(lowering_platforms=('cuda',))
  moved = re.findall(r'_xla_buffer_placement = "pinned_host".*?\(tensor<([\dx]+)x\w+>\)',
                     lowered.as_text())
  assert moved == [f'3x16x{tiny_config().model.d_model}']   # in the scan: one per layer


def test_offload_that_cannot_run_is_refused_in_one_line():
  def refusal(**overrides):
    with pytest.raises(checks.ConfigError) as e:
      run.setup(config_for('fsdp', **overrides))
    return str(e.value)
  assert 'quant.adam_bits=32' in refusal(**{'parallel.offload_optimizer': True,
                                            'quant.adam_bits': 8})
  assert 'mesh.stage=1' in refusal(**{'parallel.offload_optimizer': True, 'mesh.stage': 2,
                                      'mesh.fsdp': 4, 'parallel.pipeline_microbatches': 2})
  assert 'lora.rank' in refusal(**{'parallel.offload_frozen': True})
  assert "one of 'device', 'host'" in refusal(**{'parallel.offload_optimizer': True,
                                                 'parallel.offload_update': 'cpu'})
  assert 'parallel.offload_optimizer=True' in refusal(**{'parallel.offload_update': 'host'})
  message = checks.host_memory_refusal('parallel.offload_optimizer=True', kinds=['device'],
                                       platform='tpu')
  assert message.count('\n') == 0 and 'pinned_host' in message and 'set it to False' in message
  assert checks.host_memory_refusal('x', kinds=['device', 'pinned_host'], platform='gpu') is None


def test_an_offloaded_optimizer_state_is_created_a_weight_at_a_time_as_it_would_be_whole():
  s = run.setup(config_for('fsdp', precision='bf16_master',
                           **{'parallel.offload_optimizer': True}))
  whole, pieces = jax.device_get(s.layout.init()), s.layout.create()
  assert _kinds(pieces['opt_state']) == {OFFLOADED}
  # the master copy from the weights before their rounding to bf16, as `init` makes it
  for want, got in zip(jax.tree.leaves(whole), jax.tree.leaves(jax.device_get(pieces))):
    np.testing.assert_array_equal(got, want)
  from_params = jax.device_get(s.layout.create_optimizer(pieces['params']))
  for want, got in zip(jax.tree.leaves(jax.device_get(s.layout.init_optimizer(pieces['params']))),
                       jax.tree.leaves(from_params)):
    np.testing.assert_array_equal(got, want)
