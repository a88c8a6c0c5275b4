"""Meshes and logical-axis rules."""
import pytest
from flax.linen import logical_to_mesh_axes
from jax.sharding import PartitionSpec as P

from parallel.mesh import make_mesh, resolve_mesh_shape
from parallel.rules import layout_rules


def test_minus_one_takes_the_devices_left_over():
  assert resolve_mesh_shape({'data': -1, 'tensor': 2}, 8) == {'stage': 1, 'data': 4, 'fsdp': 1,
                                                              'context': 1, 'tensor': 2}
  assert resolve_mesh_shape({'stage': 2, 'fsdp': -1, 'tensor': 2}, 8) == {
      'stage': 2, 'data': 1, 'fsdp': 2, 'context': 1, 'tensor': 2}
  assert resolve_mesh_shape({'context': 4, 'fsdp': -1}, 8)['fsdp'] == 2


@pytest.mark.parametrize('mesh, message', [
    ({'data': 3}, 'has 3 devices but 8 are available'),
    ({'data': -1, 'tensor': 3}, 'fixed axes multiply to 3, which does not divide 8'),
    ({'data': -1, 'fsdp': -1}, 'at most one axis may take the rest'),
    ({'pipeline': 8}, "mesh axis 'pipeline' is not known"),
    ({'data': 0}, 'a mesh size is a positive integer or -1'),
])
def test_bad_meshes_are_refused_with_the_value(mesh, message):
  with pytest.raises(ValueError, match=message):
    resolve_mesh_shape(mesh, 8)


def test_make_mesh_names_every_axis():
  mesh = make_mesh({'data': -1})
  assert dict(mesh.shape) == {'stage': 1, 'data': 8, 'fsdp': 1, 'context': 1, 'tensor': 1}
  # stages outermost (across nodes); context next to tensor (it moves keys and values every layer)
  assert list(mesh.shape) == ['stage', 'data', 'fsdp', 'context', 'tensor']


def test_batch_splits_over_both_data_parallel_axes_and_the_sequence_over_context():
  assert logical_to_mesh_axes(('batch', 'length'), layout_rules(0).activations) == P(
      ('data', 'fsdp'), 'context')


@pytest.mark.parametrize('stage, sharded', [
    (0, ()), (1, ('optimizer',)), (2, ('optimizer', 'grads')), (3, ('optimizer', 'grads', 'params'))])
def test_each_zero_stage_shards_what_it_promises_over_fsdp(stage, sharded):
  rules = layout_rules(stage)
  for part in ('params', 'grads', 'optimizer'):
    spec = logical_to_mesh_axes(('layers', 'embed', 'mlp'), getattr(rules, part))
    assert spec == (P('stage', ('fsdp', 'context'), 'tensor') if part in sharded else
                    P('stage', None, 'tensor')), part


def test_tensor_parallel_splits_heads_mlp_and_vocabulary():
  rules = layout_rules(0).params
  assert logical_to_mesh_axes(('embed', 'heads', 'head_dim'), rules) == P(None, 'tensor', None)
  assert logical_to_mesh_axes(('heads', 'head_dim', 'embed'), rules) == P('tensor', None, None)
  # The vocabulary over `stage` too: a size-1 axis splits nothing without a pipeline.
  assert logical_to_mesh_axes(('vocab', 'embed'), rules) == P(('tensor', 'stage'), None)


def test_an_unknown_zero_stage_is_refused():
  with pytest.raises(ValueError, match='parallel.zero_stage=4; allowed: 0'):
    layout_rules(4)


def test_a_mesh_axis_is_used_once_per_spec_and_a_taken_rule_falls_back():
  # flax's mapping goes down the table (an earlier rule wins, whatever the dimensions' order) and
  # skips a rule whose mesh axes are taken, whole: a table that wants what is left names it in a
  # later rule for the same logical axis.
  rules = (('embed', 'fsdp'), ('mlp', ('fsdp', 'tensor')), ('mlp', 'tensor'))
  assert logical_to_mesh_axes(('embed', 'mlp'), rules) == P('fsdp', 'tensor')
  assert logical_to_mesh_axes(('mlp', 'embed'), rules) == P('tensor', 'fsdp')
  assert logical_to_mesh_axes(('mlp',), rules) == P(('fsdp', 'tensor'))
