"""Context parallelism (models/context.py): the zigzag order, the attention across shards (keys and
values gathered, or passed around a ring) against the reference on whole sequences, train steps
over 2 and 4 context shards (with every other mesh axis) equal to one device on packed documents,
a checkpoint that moves to one device, and a length the axis does not split refused in one
line."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen
from jax.sharding import NamedSharding

from models.attention import xla_attention
from models.context import _sequence_order, context_attention, zigzag_order
from parallel.mesh import make_mesh
from parallel.rules import ACTIVATIONS
from tests.helpers import reordered_rtol
from tests.test_pipeline import config, train
from train import checks, run
from train.checkpoint import Checkpointer


@pytest.mark.parametrize('length,shards', [(16, 2), (32, 4), (24, 3)])
def test_zigzag_gives_each_shard_one_chunk_from_the_front_and_one_from_the_back(length, shards):
  order = zigzag_order(length, shards)
  assert sorted(order) == list(range(length))
  chunk = length // (2 * shards)
  for r, piece in enumerate(np.split(order, shards)):
    np.testing.assert_array_equal(piece, np.concatenate([
        np.arange(r * chunk, (r + 1) * chunk),
        np.arange((2 * shards - 1 - r) * chunk, (2 * shards - r) * chunk)]))
  x = np.arange(2 * length).reshape(2, length)
  np.testing.assert_array_equal(_sequence_order(jnp.asarray(x[:, order]), shards), x)


def _packed_segments(rows: int, length: int, seed: int) -> np.ndarray:
  starts = np.random.default_rng(seed).random((rows, length)) < 0.2
  return (1 + np.cumsum(starts, axis=1)).astype(np.int32)


@pytest.mark.parametrize('method', ['gather', 'ring'])
@pytest.mark.parametrize('shards', [2, 4])
def test_context_attention_equals_the_reference_on_packed_rows(shards, method):
  """Values and gradients of q, k and v with grouped-query heads (4 query heads on 2 KV heads,
  so only KV heads move), documents crossing shard boundaries, and the other devices splitting
  the batch; the keys and values gathered, or passed around a ring."""
  b, t, heads, kv_heads, d = 4, 32, 4, 2, 8
  keys = jax.random.split(jax.random.key(0), 4)
  q = jax.random.normal(keys[0], (b, t, heads, d))
  k, v = (jax.random.normal(key, (b, t, kv_heads, d)) for key in keys[1:3])
  weights = jax.random.normal(keys[3], (b, t, heads, d))
  segments = jnp.asarray(_packed_segments(b, t, seed=shards))

  def loss(attention):
    return lambda q, k, v: jnp.sum(attention(q, k, v) * weights)

  order = zigzag_order(t, shards)
  zig = lambda x: x[:, order]
  mesh = make_mesh(dict(data=8 // shards, context=shards))

  def split(q, k, v):   # in sequence order on the outside, zigzag inside
    out = context_attention(*map(zig, (q, k, v)), zig(segments), shards, method)
    return out[:, np.argsort(order)]

  def reference(q, k, v):
    return xla_attention(q, k, v, segments)

  want = reference(q, k, v)
  want_grads = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
  with jax.set_mesh(mesh), linen.logical_axis_rules(ACTIVATIONS):
    placed = [jax.device_put(x, NamedSharding(mesh, linen.logical_to_mesh_axes(
        ('batch', None, 'heads' if x.shape[2] == heads else 'kv_heads', None), ACTIVATIONS)))
              for x in (q, k, v)]
    got = jax.jit(split)(*placed)
    grads = jax.jit(jax.grad(loss(split), argnums=(0, 1, 2)))(*placed)
  # As tests/test_attention.py: the longest sums are a row of t probabilities times values and a
  # gradient over t positions, here added in another order (key blocks, shards).
  rtol = 4 * reordered_rtol(t * d)
  bound = lambda reference: rtol * float(jnp.max(jnp.abs(reference)))
  assert jnp.max(jnp.abs(got - want)) <= bound(want)
  for name, g, w in zip('qkv', grads, want_grads):
    assert jnp.max(jnp.abs(g - w)) <= bound(w), f'd{name}'


ONE_DEVICE = {'mesh': dict(stage=1, data=1, fsdp=1, context=1, tensor=1), 'parallel.zero_stage': 0}
SHAPE = {'train.seq_len': 32, 'model.loss_chunk': 8}
LAYOUTS = {
    'context2-data4-zero3': {'mesh': dict(stage=1, data=4, fsdp=1, context=2, tensor=1),
                             'parallel.zero_stage': 3},
    'context4-fsdp2-zero3': {'mesh': dict(stage=1, data=1, fsdp=2, context=4, tensor=1),
                             'parallel.zero_stage': 3},
    'context2-tensor2-zero1-remat-accumulation': {
        'mesh': dict(stage=1, data=1, fsdp=2, context=2, tensor=2), 'parallel.zero_stage': 1,
        'model.remat': 'full', 'train.microbatches': 2},
    'context2-stage2-1f1b': {'mesh': dict(stage=2, data=2, fsdp=1, context=2, tensor=1),
                             'parallel.zero_stage': 0, 'parallel.pipeline_schedule': '1f1b'},
    'ring-context4-fsdp2-zero3': {'mesh': dict(stage=1, data=1, fsdp=2, context=4, tensor=1),
                                  'parallel.zero_stage': 3, 'model.context_attention': 'ring'},
    'ring-context2-tensor2-zero1-remat-accumulation': {
        'mesh': dict(stage=1, data=1, fsdp=2, context=2, tensor=2), 'parallel.zero_stage': 1,
        'model.remat': 'full', 'train.microbatches': 2, 'model.context_attention': 'ring'},
}


@pytest.fixture(scope='module')
def reference():
  losses, params, _ = train(config(8, **SHAPE, **ONE_DEVICE), devices=jax.devices()[:1],
                            packed=True)
  return losses, params


@pytest.mark.parametrize('name', list(LAYOUTS))
def test_packed_steps_over_context_shards_equal_one_device(name, reference):
  losses, params, s = train(config(8, **SHAPE, **LAYOUTS[name]), packed=True)
  assert s.mesh.shape['context'] > 1
  want_losses, want_params = reference
  np.testing.assert_allclose(losses, want_losses, rtol=reordered_rtol(8 * 32))
  # As tests/test_pipeline.py: Adam amplifies the summation-order noise of a gradient that nearly
  # cancels over the steps for a few weights in 10^5; a wrong split (a key a query should not see,
  # a position out of place) moves nearly every weight by the order of a step.
  lr = s.config.train.learning_rate
  diff = np.concatenate([np.abs(got - want).ravel() for got, want in
                         zip(jax.tree.leaves(params), jax.tree.leaves(want_params))])
  assert np.quantile(diff, 0.999) <= 1e-3 * lr
  assert diff.max() <= 0.1 * lr


def test_rows_of_several_sequences_keep_their_context_split():
  """4 rows a device (8 rows over 2-way fsdp, each split over 4 context devices): the dense
  products keep [batch, length] as they are. Flattened into rows, XLA could not keep the length's
  split and gathered each sequence whole on every device of its context group (2.8x these bytes
  gathered here; 7b at 128k tokens on 8 H100s: 111 GiB a device, not 97, and each device
  computing its peers' tokens too): the step gathers what one row a device gathers (the weights),
  and less than one more activation of the batch."""
  def gathered(batch):
    s = run.setup(config(batch, **SHAPE, **LAYOUTS['ring-context4-fsdp2-zero3']))
    collectives = run.memory_report(s, run.compile_train_step(s))['collectives_per_step']
    return collectives['all-gather']['bytes'], s
  (one_row, _), (four_rows, s) = gathered(2), gathered(8)
  activation = 8 * s.config.train.seq_len * s.model.d_model * 4   # [batch, length, d_model] fp32
  assert four_rows - one_row < activation


def test_a_length_the_context_axis_does_not_split_is_refused_in_one_line():
  c = config(8, **{'mesh': dict(stage=1, data=2, fsdp=1, context=4, tensor=1),
                   'parallel.zero_stage': 0, 'train.seq_len': 36})
  with pytest.raises(checks.ConfigError) as refused:
    run.setup(c)
  message = str(refused.value)
  assert '\n' not in message
  assert 'train.seq_len=36' in message and 'mesh.context=4' in message and 'multiple of 8' in message
  # Without a context axis any length is taken, an odd one too.
  odd = config(8, **{'mesh': dict(stage=1, data=8, fsdp=1, context=1, tensor=1),
                     'parallel.zero_stage': 0, 'train.seq_len': 127})
  checks.check_config(odd, data_parallel=8, process_count=1, tokenizer_vocab=256, context=1)


def test_a_checkpoint_moves_from_context_shards_to_one_device(tmp_path):
  """The state sharded over fsdp x context (ZeRO-3), d_model 68 stored padded to 72 over the 8
  devices, restores on one device as the same seed's weights, whole and unpadded."""
  shape = {'model.d_model': 68, 'model.num_heads': 2, 'model.num_kv_heads': 2}
  split = run.setup(config(8, **SHAPE, **shape, **LAYOUTS['context4-fsdp2-zero3']))
  single = run.setup(config(8, **SHAPE, **shape, **ONE_DEVICE), jax.devices()[:1])
  state = split.layout.init()
  stored = jax.tree.leaves(state['params'])
  assert any(72 in leaf.shape for leaf in stored) and not any(68 in leaf.shape for leaf in stored)
  checkpoints = Checkpointer(str(tmp_path / 'c'), keep=1)
  checkpoints.save(1, state, {'step': 1}, run.checkpoint_meta(split))
  checkpoints.wait()
  checkpoints.check_compatible(1, single.layout.abstract, run.checkpoint_meta(single))
  restored = checkpoints.restore_newest(single.layout.abstract, unpadded=single.layout.unpadded)
  checkpoints.close()
  want = jax.device_get(single.layout.init()['params'])
  for a, b in zip(jax.tree.leaves(jax.device_get(restored.state['params'])), jax.tree.leaves(want)):
    np.testing.assert_array_equal(a, b)
