"""Uneven shards (parallel/padding.py): every ZeRO stage on a mesh whose fsdp size does not divide
d_model, against one device, and its checkpoints across meshes that pad otherwise or not at all."""
import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from parallel.mesh import make_mesh
from parallel.padding import Shapes, fit, padded_shape
from tests.helpers import random_tokens, reordered_rtol, tiny_config
from train import run
from train.checks import ConfigError
from train.checkpoint import Checkpointer


def test_only_the_zero_axis_is_padded_and_fit_cuts_or_zero_pads():
  mesh = make_mesh({'fsdp': 3, 'tensor': 2}, jax.devices()[:6])
  assert padded_shape((64, 10), NamedSharding(mesh, PartitionSpec('fsdp', 'tensor'))) == (66, 10)
  assert padded_shape((7,), NamedSharding(mesh, PartitionSpec(None))) == (7,)
  x = np.arange(6.0).reshape(2, 3)
  np.testing.assert_array_equal(fit(x, (3, 2)), [[0, 1], [3, 4], [0, 0]])
  assert Shapes.of({'a': x}).fit({'a': fit(x, (4, 4))})['a'].shape == (2, 3)


def test_a_tensor_axis_that_does_not_divide_the_heads_is_refused_in_one_line():
  config = tiny_config(**{'mesh.data': 1, 'mesh.fsdp': 1, 'mesh.tensor': 3, 'train.batch_size': 6})
  with pytest.raises(ConfigError, match=r'heads\) of size 2, which the mesh axes tensor=3'):
    run.setup(config, jax.devices()[:3])


def _config(zero_stage: int, devices: int):
  return tiny_config(**{'train.batch_size': 6, 'parallel.zero_stage': zero_stage,
                        'mesh.data': 1, 'mesh.fsdp': devices})


def _true(s, state):
  """The state's arrays cut to their true shapes, on the host, by path."""
  unpadded = s.layout.unpadded
  return {path: np.asarray(leaf)[tuple(slice(0, n) for n in unpadded.get(path, leaf.shape))]
          for path, leaf in run._flat_paths(state).items()}


@pytest.mark.parametrize('zero_stage', [1, 2, 3])
def test_each_zero_stage_on_a_mesh_that_does_not_divide_d_model_matches_one_device(zero_stage):
  """d_model 64 over 3 devices: stored padded to 66 (zeros), trained like one device."""
  s, one = run.setup(_config(zero_stage, 3), jax.devices()[:3]), run.setup(
      _config(zero_stage, 1), jax.devices()[:1])
  padded = s.layout.unpadded
  assert any(p.startswith('opt_state') for p in padded)
  assert any(p.startswith('params') for p in padded) == (zero_stage == 3)
  state, one_state = s.layout.init(), one.layout.init()
  for step in range(3):
    tokens = random_tokens((6, 65), seed=step)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    with one.context():
      one_state, one_metrics = one.train_step(one_state, batch)
    np.testing.assert_allclose(metrics['loss'], one_metrics['loss'],
                               rtol=reordered_rtol(batch['inputs'].size))
  for path, leaf in run._flat_paths(state).items():
    if path in padded:   # the padding stays zero: no gradient, moment or update reaches it
      held = np.asarray(leaf)
      true = tuple(slice(0, n) for n in padded[path])
      assert np.count_nonzero(held) == np.count_nonzero(held[true]), path
  assert _true(s, state).keys() == _true(one, one_state).keys()


def test_checkpoints_move_between_meshes_that_pad_otherwise_with_the_same_values(tmp_path):
  """Saved on 3 devices (padded to 66), read on 2 (not padded) and 1, and saved on 1 and read on
  3: the true arrays bit for bit, the digests verified, the padding zeros."""
  layouts = {n: run.setup(_config(3, n), jax.devices()[:n]) for n in (3, 2, 1)}
  three = layouts[3]
  state = three.layout.init()
  with three.context():   # a step, so that the moments are not zeros
    tokens = random_tokens((6, 65))
    state, _ = three.train_step(state, {
        'inputs': jax.device_put(tokens[:, :-1], three.batch_sharding),
        'targets': jax.device_put(tokens[:, 1:], three.batch_sharding)})
  saved = _true(three, state)
  checkpoints = Checkpointer(str(tmp_path / 'from3'), keep=2)
  checkpoints.save(1, state, {'step': 1}, run.checkpoint_meta(three))
  checkpoints.wait()
  for n, s in layouts.items():
    checkpoints.check_compatible(1, s.layout.abstract, run.checkpoint_meta(s))
    restored = checkpoints.restore_newest(s.layout.abstract, unpadded=s.layout.unpadded)
    values = _true(s, restored.state)
    for path in saved:
      np.testing.assert_array_equal(values[path], saved[path], err_msg=f'{n} devices: {path}')
  checkpoints.close()

  one = layouts[1]
  back = Checkpointer(str(tmp_path / 'from1'), keep=2)
  one_state = one.layout.init()
  back.save(1, one_state, {'step': 1}, run.checkpoint_meta(one))
  back.wait()
  restored = back.restore_newest(three.layout.abstract, unpadded=three.layout.unpadded).state
  back.close()
  mine = _true(three, restored)
  for path, value in _true(one, one_state).items():
    np.testing.assert_array_equal(mine[path], value, err_msg=path)
  for path, true in three.layout.unpadded.items():
    held = np.asarray(run._flat_paths(restored)[path])
    assert np.count_nonzero(held) == np.count_nonzero(held[tuple(slice(0, n) for n in true)])



def _saved_run(directory, devices: int):
  """A workdir as a run leaves it (config.json, one checkpoint) on `devices` devices, and the
  state it saved."""
  import json
  config = _config(3, devices)
  s = run.setup(config, jax.devices()[:devices])
  state = s.layout.init()
  checkpoints = Checkpointer(str(directory / 'checkpoints'), keep=1)
  checkpoints.save(1, state, {'step': 1}, run.checkpoint_meta(s))
  checkpoints.wait()
  checkpoints.close()
  with open(directory / 'config.json', 'w') as f:
    json.dump(config.to_dict(), f)
  return s, state


@pytest.mark.parametrize('saved_on, loaded_on', [(3, 1), (1, 3)])
def test_init_from_a_run_moves_weights_between_meshes_that_pad_otherwise(tmp_path, saved_on,
                                                                         loaded_on):
  from train import init_from
  source_setup, source_state = _saved_run(tmp_path, saved_on)
  config = _config(3, loaded_on)
  config.init_from = f'run:{tmp_path}'
  s = run.setup(config, jax.devices()[:loaded_on])
  state = init_from.initial_state(s, run._open_source(config))
  want, have = _true(source_setup, source_state), _true(s, state)
  params = [p for p in want if p.startswith('params/')]
  assert params and any(p in (s.layout.unpadded | source_setup.layout.unpadded) for p in params)
  for path in params:
    np.testing.assert_array_equal(have[path], want[path], err_msg=path)
  with s.context():   # and it trains from there
    tokens = random_tokens((6, 65))
    _, metrics = s.train_step(state, {'inputs': jax.device_put(tokens[:, :-1], s.batch_sharding),
                                      'targets': jax.device_put(tokens[:, 1:], s.batch_sharding)})
  assert np.isfinite(float(metrics['loss']))


def test_8bit_moments_blocked_from_padded_weights_are_refused_on_a_mesh_that_pads_otherwise(
    tmp_path):
  """Their blocks follow the padded weight, so another padding would reorder them: one line."""
  from train.checkpoint import CheckpointError
  eight_bit = {'quant.adam_bits': 8, 'quant.adam_block_size': 256}
  three = run.setup(tiny_config(**{**eight_bit, 'train.batch_size': 6, 'mesh.data': 1,
                                   'mesh.fsdp': 3, 'parallel.zero_stage': 3}), jax.devices()[:3])
  two = run.setup(tiny_config(**{**eight_bit, 'train.batch_size': 6, 'mesh.data': 1,
                                 'mesh.fsdp': 2, 'parallel.zero_stage': 3}), jax.devices()[:2])
  checkpoints = Checkpointer(str(tmp_path / 'c'), keep=1)
  checkpoints.save(1, three.layout.init(), {'step': 1}, run.checkpoint_meta(three))
  checkpoints.wait()
  checkpoints.check_compatible(1, three.layout.abstract, run.checkpoint_meta(three))
  with pytest.raises(CheckpointError, match=r'8-bit Adam moments of .* padded to \[2, 66, .* '
                                            r'which this mesh holds unpadded'):
    checkpoints.check_compatible(1, two.layout.abstract, run.checkpoint_meta(two))
  checkpoints.close()
