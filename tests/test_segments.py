"""Packed rows (several documents per row, `segments`): each attention implementation, the model's
losses and the pipeline give every document what it gets alone; ignored targets cost nothing.

Tolerances: the packed and the lone runs compute the same terms, the packed one with exact zeros
(masked keys) among them and in differently shaped products, so they differ by fp32 summation
order only: for attention `reordered_rtol` of the longest sum, as in tests/test_attention.py; for
the model's losses (~5 nats, through two layers of sums of at most 192 terms) fp32's usual
rtol 1e-5, atol 1e-6."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.attention import cudnn_attention, flash_attention, xla_attention
from models.layers import rope_tables
from models.llama import scan_layers, segment_positions
from models.loss import token_losses
from parallel.mesh import make_mesh
from parallel.pipeline import PipelineSchedule, pipelined
from tests.helpers import random_tokens, reordered_rtol, split_params, tiny_model
from tests.test_attention import _inputs, _value_and_grads

# Row 0: document A (5 positions), B (7), then 3 of padding; row 1: C (9), D (6), no padding.
DOCUMENTS = [[(1, 5), (2, 7), (0, 3)], [(1, 9), (2, 6)]]
LENGTH = 15


def _segments(rows=DOCUMENTS) -> np.ndarray:
  return np.asarray([np.repeat([s for s, _ in row], [n for _, n in row]) for row in rows], np.int32)


def _spans(row):
  """(start, stop) of each document (segment > 0) of a row of DOCUMENTS."""
  starts = np.cumsum([0] + [n for _, n in row])
  return [(int(a), int(a + n)) for a, (s, n) in zip(starts, row) if s > 0]


def test_positions_restart_at_each_segment():
  segments = jnp.asarray([[1, 1, 1, 2, 2, 0, 0], [3, 3, 3, 3, 3, 3, 3], [1, 2, 3, 3, 4, 4, 4]])
  want = [[0, 1, 2, 0, 1, 0, 1], [0, 1, 2, 3, 4, 5, 6], [0, 0, 0, 1, 0, 1, 2]]
  np.testing.assert_array_equal(segment_positions(segments), want)


# ---- attention -------------------------------------------------------------------------------
IMPLEMENTATIONS = {   # segments=None: plain causal attention
    'xla': xla_attention,
    'flash-4': lambda q, k, v, segments=None: flash_attention(q, k, v, 4, segments),
    'flash-8': lambda q, k, v, segments=None: flash_attention(q, k, v, 8, segments),
}


def _within(fn, segments):
  return functools.partial(fn, segments=segments)


def _assert_close(got, want, rtol, what=''):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  assert np.isfinite(got).all(), what
  assert np.max(np.abs(got - want)) <= rtol * np.max(np.abs(want)), what


@pytest.mark.parametrize('name', list(IMPLEMENTATIONS))
def test_each_document_of_a_packed_row_attends_as_if_alone(name):
  fn = IMPLEMENTATIONS[name]
  qkv, weights = _inputs(2, LENGTH, 4, 2, 8)
  segments = jnp.asarray(_segments())
  out, grads = _value_and_grads(_within(fn, segments), qkv, weights)
  _, want_grads = _value_and_grads(_within(xla_attention, segments), qkv, weights)
  rtol = 4 * reordered_rtol(LENGTH * qkv[0].shape[-1])
  alone_fn = jax.jit(fn)   # as the packed rows are: one compile per length, not per operation
  for row, documents in enumerate(DOCUMENTS):
    for start, stop in _spans(documents):
      alone = alone_fn(*(x[row:row + 1, start:stop] for x in qkv))
      _assert_close(out[row, start:stop], alone[0], rtol, (row, start))
  assert np.isfinite(np.asarray(out)).all()   # the padding positions too
  for axis, g, want in zip('qkv', grads, want_grads):
    _assert_close(g, want, rtol, f'd{axis}')


@pytest.mark.parametrize('name', list(IMPLEMENTATIONS))
def test_one_segment_per_row_is_plain_causal_attention(name):
  fn = IMPLEMENTATIONS[name]
  qkv, _ = _inputs(2, LENGTH, 4, 2, 8)
  ones = jnp.ones(qkv[0].shape[:2], jnp.int32)
  np.testing.assert_array_equal(fn(*qkv, segments=ones), fn(*qkv))


@pytest.mark.skipif(jax.default_backend() != 'gpu', reason='cuDNN runs only on a GPU')
def test_cudnn_with_segments_equals_xla_in_bf16():
  qkv, weights = _inputs(2, 64, 4, 2, 64, jnp.bfloat16)
  segments = jnp.asarray(np.repeat([[1, 2, 3, 0], [1, 1, 2, 2]], 16, axis=1).astype(np.int32))
  out, grads = _value_and_grads(_within(cudnn_attention, segments), qkv, weights)
  want, want_grads = _value_and_grads(_within(xla_attention, segments), qkv, weights)
  # Both round the probabilities and the scores' gradient to bf16 before a product, at different
  # points: a few bf16 ulps of the largest value (as for flash in tests/test_attention.py).
  ulp = float(jnp.finfo(jnp.bfloat16).eps)
  _assert_close(out, want, 4 * ulp)
  for axis, g, w in zip('qkv', grads, want_grads):
    _assert_close(g, w, 16 * ulp, f'd{axis}')


# ---- the model -------------------------------------------------------------------------------
def _packed_batch(vocab: int, rows=DOCUMENTS, seed: int = 0):
  """Inputs, targets and segments of the packed rows, and each document's own (inputs, targets)
  with its (row, start, stop): a document's last target is its real next token alone, and
  ignored (-1, it would be the next document's) when packed; padding targets are ignored."""
  rng = np.random.default_rng(seed)
  inputs = np.zeros((len(rows), sum(n for _, n in rows[0])), np.int32)
  targets = np.full(inputs.shape, -1, np.int32)
  documents = []
  for r, row in enumerate(rows):
    for start, stop in _spans(row):
      tokens = rng.integers(0, vocab, stop - start + 1, dtype=np.int32)
      inputs[r, start:stop] = tokens[:-1]
      targets[r, start:stop - 1] = tokens[1:-1]
      documents.append((r, start, stop, tokens[None, :-1], tokens[None, 1:]))
  return inputs, targets, _segments(rows), documents


@pytest.mark.parametrize('fields', [
    dict(attention='flash'),
    dict(attention='xla', loss_chunk=4),   # the chunked loss, its last chunk padded
    dict(attention='flash', positions='learned', norm='layer', mlp='gelu', bias=True),   # GPT-2
], ids=['rope-flash', 'rope-xla-chunked', 'learned'])
def test_packed_losses_equal_each_document_alone(fields):
  cfg, model = tiny_model(**fields)
  inputs, targets, segments, documents = _packed_batch(cfg.vocab_size)
  packed = np.asarray(jax.jit(lambda i, t, s: model.token_losses(i, t, segments=s))(
      inputs, targets, segments))
  np.testing.assert_array_equal(packed[targets < 0], 0.0)
  # Jitted, as the packed row is (one compile per document length, not one per operation).
  losses_alone = jax.jit(lambda i, t: model.token_losses(i, t))
  for row, start, stop, alone_inputs, alone_targets in documents:
    alone = np.asarray(losses_alone(alone_inputs, alone_targets))[0]
    # The packed row predicts all of the document's targets but the last (the next document's).
    np.testing.assert_allclose(packed[row, start:stop - 1], alone[:-1], rtol=1e-5, atol=1e-6)


def test_rotary_tables_restart_at_each_document():
  """Rotary scores depend only on relative positions, so the losses above would barely move if
  the angles ran on across documents; the blocks must get each document's own tables (those
  generation uses), which a stack sees in its per-row inputs."""
  cfg, model = tiny_model(attention='xla')
  inputs, targets, segments, documents = _packed_batch(cfg.vocab_size)
  seen = {}

  def recording_stack(layer, layers, x, keys, rows):
    seen.update(rows)
    return scan_layers(layer, layers, x, keys, rows)

  model.token_losses(inputs, targets, segments=segments, stack=recording_stack)
  np.testing.assert_array_equal(seen['segments'], segments)
  for row, start, stop, *_ in documents:
    cos, sin = rope_tables(jnp.arange(stop - start)[None], cfg.head_dim, cfg.rope_theta, cfg)
    np.testing.assert_array_equal(seen['cos'][row, start:stop], cos[0])
    np.testing.assert_array_equal(seen['sin'][row, start:stop], sin[0])


def test_ignored_targets_have_no_gradient():
  """The loss at a target < 0 is 0 whatever that target's value: changing it changes nothing."""
  cfg, model = tiny_model(attention='xla')
  tokens = jnp.asarray(random_tokens((2, 12)))
  targets = jnp.roll(tokens, -1, axis=1).at[:, -3:].set(-1)
  lowered = targets.at[:, -3:].set(-100)
  losses_of = jax.jit(lambda t: model.token_losses(tokens, t))   # one compile, not one per op
  losses = losses_of(targets)
  np.testing.assert_array_equal(losses, losses_of(lowered))
  np.testing.assert_array_equal(losses[:, -3:], 0.0)

  def hidden_grad(tokens):
    x, head = model.hidden(tokens)
    return jax.grad(lambda x: token_losses(head, x, targets).sum())(x)

  grad = jax.jit(hidden_grad)(tokens)
  np.testing.assert_array_equal(grad[:, -3:], 0.0)


# ---- the pipeline ----------------------------------------------------------------------------
PIPELINE_ROWS = [   # 4 rows, each packed differently: a row given another row's segments shows
    [(1, 6), (2, 6), (3, 4)],
    [(1, 16)],
    [(1, 3), (2, 9), (0, 4)],
    [(1, 11), (0, 5)],
]


@pytest.mark.parametrize('schedule', [PipelineSchedule('gpipe', 2, 2),
                                      PipelineSchedule('circular', 2, 2, repeats=2)],
                         ids=['gpipe', 'circular'])
def test_pipelined_packed_losses_and_gradients_equal_the_unpipelined_ones(schedule):
  cfg, model = tiny_model(num_layers=4, attention='xla')
  inputs, targets, segments, _ = _packed_batch(cfg.vocab_size, PIPELINE_ROWS)
  graphdef, params = split_params(model)

  def losses_and_grads(stack):
    def losses(params):
      model = nnx.merge(graphdef, params)
      return model.token_losses(inputs, targets, segments=segments, stack=stack)
    return jax.jit(lambda p: (losses(p), jax.grad(lambda p: losses(p).sum())(p)))(params)

  want, want_grads = losses_and_grads(None)
  with jax.set_mesh(make_mesh(dict(stage=2, data=1, fsdp=1, tensor=1), jax.devices()[:2])):
    got, grads = losses_and_grads(pipelined(schedule))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    _assert_close(g, w, 1e-5)
