"""Every parallel layout on 8 simulated devices: same losses as one device, the promised shardings,
and the memory each ZeRO stage promises."""
import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from configs import default
from configs.layouts import LAYOUTS, layout_config
from tests.helpers import random_tokens, reordered_rtol
from train import checks, run

# Wide enough that every dimension divides 8 fsdp ways and 4 tensor ways, deep enough for 4 stages.
SHAPE = {'model.d_model': 64, 'model.num_heads': 4, 'model.num_kv_heads': 4, 'model.mlp_dim': 128,
         'model.num_layers': 4, 'train.batch_size': 8, 'train.seq_len': 16}


def config_for(layout: str, **overrides):
  config = layout_config(layout, 'tiny')
  for key, value in {**SHAPE, **overrides}.items():
    default.override(config, key, value)
  return config


def batches(n=3, rows=8):
  for i in range(n):
    tokens = random_tokens((rows, 17), seed=i)
    yield {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}


def train_from(s, state) -> list[float]:
  """The losses of `s`'s train step from `state` over `batches()`."""
  out = []
  for batch in batches(rows=s.config.train.batch_size):
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    out.append(float(metrics['loss']))
  return out


def losses(config, devices=None) -> list[float]:
  s = run.setup(config, devices)
  return train_from(s, s.layout.init()), s


@pytest.fixture(scope='module')
def single_device_losses():
  out, s = losses(config_for('ddp'), devices=jax.devices()[:1])
  assert s.mesh.size == 1
  return out


# The pipeline layout's losses and parameters: tests/test_pipeline.py.
FLAT_LAYOUTS = sorted(set(LAYOUTS) - {'pipeline'})


@pytest.mark.parametrize('layout', FLAT_LAYOUTS)
def test_first_three_losses_equal_the_single_device_run(layout, single_device_losses):
  got, s = losses(config_for(layout))
  assert s.mesh.size == 8
  # Each loss is a mean over the batch's tokens, which another layout sums in another order.
  tokens = s.config.train.batch_size * s.config.train.seq_len
  np.testing.assert_allclose(got, single_device_losses, rtol=reordered_rtol(tokens))


@pytest.fixture(scope='module')
def single_device_losses_16_rows():
  out, _ = losses(config_for('ddp', **{'train.batch_size': 16}), devices=jax.devices()[:1])
  return out


@pytest.mark.parametrize('layout', FLAT_LAYOUTS)
def test_with_two_microbatches_losses_still_equal_the_single_device_run(
    layout, single_device_losses_16_rows):
  got, s = losses(config_for(layout, **{'train.batch_size': 16, 'train.microbatches': 2}))
  # A mean over the batch's tokens, summed per microbatch, per device and across them.
  tokens = s.config.train.batch_size * s.config.train.seq_len
  np.testing.assert_allclose(got, single_device_losses_16_rows, rtol=reordered_rtol(tokens))


@pytest.mark.parametrize('layout', ['ddp', 'zero1'])
def test_replicated_gradients_are_reduced_once_per_step_not_per_microbatch(layout):
  """DDP and ZeRO-1 sum each device's microbatch gradients locally (PyTorch DDP's no_sync)."""
  def all_reduce(microbatches):
    s = run.setup(config_for(layout, **{'train.batch_size': 32, 'train.microbatches': microbatches}))
    return run.memory_report(s, run.compile_train_step(s))['collectives_per_step']['all-reduce']
  one, four = all_reduce(1), all_reduce(4)
  assert four['bytes'] <= one['bytes']


# The ZeRO axes: state is sharded over fsdp and context together (a size-1 axis splits nothing).
ZERO = ('fsdp', 'context')

# (parameter spec, Adam moment spec) of the stacked MLP gate kernel [layers, embed, mlp]. The rule
# tables are the same for every layout, so `layers` always names `stage` and `mlp` `tensor`: where
# that axis has size 1 (every layout but pipeline; but tp and fsdp_tp) it splits nothing.
EXPECTED_GATE_SPECS = {
    'ddp': (P('stage', None, 'tensor'), P('stage', None, 'tensor')),
    'zero1': (P('stage', None, 'tensor'), P('stage', ZERO, 'tensor')),
    'zero2': (P('stage', None, 'tensor'), P('stage', ZERO, 'tensor')),
    'fsdp': (P('stage', ZERO, 'tensor'), P('stage', ZERO, 'tensor')),
    'tp': (P('stage', None, 'tensor'), P('stage', None, 'tensor')),
    'fsdp_tp': (P('stage', ZERO, 'tensor'), P('stage', ZERO, 'tensor')),
    'pipeline': (P('stage', ZERO, 'tensor'), P('stage', ZERO, 'tensor')),
}


def _normalise(spec):
  """Drop trailing Nones, so P(None, 'fsdp') and P(None, 'fsdp', None) compare equal."""
  parts = list(spec)
  while parts and parts[-1] is None:
    parts.pop()
  return P(*parts)


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_parameter_and_optimizer_state_shardings_are_the_expected_specs(layout):
  config = config_for(layout, **{'train.steps': 1})
  s = run.setup(config)
  state = s.layout.init()
  param_spec, moment_spec = EXPECTED_GATE_SPECS[layout]
  gate = state['params']['blocks']['mlp']['gate']['kernel']
  adam = state['opt_state'][1][0]   # chain(clip, adamw = chain(scale_by_adam, ...))
  assert _normalise(gate.sharding.spec) == _normalise(param_spec)
  tensor_ways = s.mesh.shape['tensor']
  assert gate.addressable_shards[0].data.shape[2] == gate.shape[2] // tensor_ways
  assert _normalise(adam.mu['blocks']['mlp']['gate']['kernel'].sharding.spec) == _normalise(moment_spec)
  assert _normalise(adam.nu['blocks']['mlp']['gate']['kernel'].sharding.spec) == _normalise(moment_spec)
  # The vocabulary is split over `tensor` and `stage`: no pipeline stage stores a whole table.
  embedding = state['params']['embedding']
  expected_embedding = P(('tensor', 'stage'),
                         ZERO if layout in ('fsdp', 'fsdp_tp', 'pipeline') else None)
  assert _normalise(embedding.sharding.spec) == _normalise(expected_embedding)
  vocabulary_ways = tensor_ways * s.mesh.shape['stage']
  assert embedding.addressable_shards[0].data.shape[0] == embedding.shape[0] // vocabulary_ways
  for moment in (adam.mu, adam.nu):
    assert moment['embedding'].addressable_shards[0].data.shape[0] == (
        embedding.shape[0] // vocabulary_ways)


def expected_spec(axes: tuple, fsdp_sharded: bool) -> P:
  """What the rule tables promise, written out independently of parallel/rules.py."""
  mesh_axis = {'embed': ZERO if fsdp_sharded else None, 'heads': 'tensor', 'kv_heads': 'tensor',
               'mlp': 'tensor', 'vocab': ('tensor', 'stage'), 'layers': 'stage'}
  return P(*(mesh_axis.get(a) for a in axes))


WEIGHTS = {  # path in params -> logical axes
    ('blocks', 'attention', 'query', 'kernel'): ('layers', 'embed', 'heads', 'head_dim'),
    ('blocks', 'attention', 'key', 'kernel'): ('layers', 'embed', 'kv_heads', 'head_dim'),
    ('blocks', 'attention', 'out', 'kernel'): ('layers', 'heads', 'head_dim', 'embed'),
    ('blocks', 'mlp', 'down', 'kernel'): ('layers', 'mlp', 'embed'),
    ('blocks', 'attention_norm', 'scale'): ('layers', 'embed'),
    ('final_norm', 'scale'): ('embed',),
}


@pytest.mark.parametrize('layout', sorted(LAYOUTS))
def test_every_kind_of_weight_and_its_moments_are_placed_as_the_stage_promises(layout):
  s = run.setup(config_for(layout))
  params_sharded = layout in ('fsdp', 'fsdp_tp', 'pipeline')
  moments_sharded = layout not in ('ddp', 'tp')
  params, moments = s.layout.shardings['params'], s.layout.shardings['opt_state'][1][0].mu
  for path, axes in WEIGHTS.items():
    param, moment = params, moments
    for key in path:
      param, moment = param[key], moment[key]
    assert _normalise(param.spec) == _normalise(expected_spec(axes, params_sharded)), (layout, path)
    assert _normalise(moment.spec) == _normalise(expected_spec(axes, moments_sharded)), (layout, path)


def compiled_bytes(layout: str) -> dict:
  # Parameters dominate: a wide model, a short batch.
  config = config_for(layout, **{'model.d_model': 256, 'model.mlp_dim': 1024, 'model.num_heads': 8,
                                 'model.num_kv_heads': 4, 'model.head_dim': 32,
                                 'train.batch_size': 16, 'train.seq_len': 16, 'train.microbatches': 2})
  s = run.setup(config)
  return run.memory_report(s, run.compile_train_step(s))


@pytest.fixture(scope='module')
def stage_bytes():
  return {layout: compiled_bytes(layout) for layout in ('ddp', 'zero1', 'zero2', 'fsdp')}


def test_zero3_argument_bytes_are_at_most_a_sixth_of_ddp(stage_bytes):
  ddp = stage_bytes['ddp']['per_device_bytes']['arguments']
  assert stage_bytes['fsdp']['per_device_bytes']['arguments'] <= ddp / 6


def test_zero1_shrinks_only_the_optimizer_state(stage_bytes):
  ddp, zero1 = (stage_bytes[k]['per_device_bytes'] for k in ('ddp', 'zero1'))
  params_bytes = 4 * stage_bytes['ddp']['num_params']
  moments = 2 * params_bytes
  # Arguments lose 7/8 of the two Adam moments, nothing else; the step's temporaries stay.
  assert abs((ddp['arguments'] - zero1['arguments']) - moments * 7 / 8) < 0.02 * moments
  assert abs(zero1['temp'] - ddp['temp']) < 0.05 * ddp['temp']


def test_zero2_also_shards_the_gradients(stage_bytes):
  zero1, zero2 = (stage_bytes[k]['per_device_bytes'] for k in ('zero1', 'zero2'))
  grads = 4 * stage_bytes['ddp']['num_params']
  assert zero2['arguments'] == zero1['arguments']      # parameters still replicated
  # The gradient accumulator (and each microbatch's gradients) are 1/8 the size.
  assert zero1['temp'] - zero2['temp'] > 0.75 * grads


def test_zero3_gathers_parameters_and_ddp_does_not(stage_bytes):
  assert stage_bytes['fsdp']['collectives_per_step']['all-gather']['count'] > 0
  assert stage_bytes['ddp']['collectives_per_step']['all-gather']['count'] == 0
  assert stage_bytes['ddp']['collectives_per_step']['all-reduce']['count'] > 0


@pytest.mark.parametrize('overrides, message', [
    ({'mesh.fsdp': 3}, 'has 3 devices but 8 are available'),
    ({'mesh.tensor': 8, 'mesh.fsdp': 1}, r'key/kernel dimension 2 \(kv_heads\) of size 4, which the mesh axes tensor=8'),
    ({'train.batch_size': 4}, 'train.batch_size=4 is not divisible by 8 data-parallel devices'),
    ({'model.vocab_size': 258, 'mesh.tensor': 4, 'mesh.fsdp': 2},
     r'embedding dimension 0 \(vocab\) of size 258, which the mesh axes tensor=4'),
    ({'parallel.zero_stage': 5}, r'parallel.zero_stage=5; allowed: 0 \(DDP\)'),
])
def test_layouts_that_do_not_fit_the_mesh_are_refused_naming_the_sizes(overrides, message):
  with pytest.raises(checks.ConfigError, match=message):
    run.setup(config_for('fsdp', **overrides))


def test_an_unknown_mesh_axis_is_refused():
  config = config_for('fsdp')
  config.mesh = {'data': 1, 'fsdp': -1, 'pipe': 1}
  with pytest.raises(checks.ConfigError,
                     match="mesh axis 'pipe' is not known; allowed: stage, data, fsdp, context, tensor"):
    run.setup(config)
