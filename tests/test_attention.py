"""Every attention implementation equals the written-out reference (`xla`) in value and gradient,
for grouped and plain multi-head attention, at lengths that are and are not a multiple of the flash
block; the chunked loss equals the whole-sequence one; bad choices are refused in one line.

Tolerances: fp32 runs differ only in summation order (the online softmax sums block by block), so
they are bounded by `reordered_rtol` of the longest sum; 16-bit runs by a few ulps of the format
(both round the probabilities and the gradients of the scores to it before a product)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import presets
from models import ModelConfig, Transformer
from models.attention import attend, flash_attention, refusal, resolve, xla_attention
from precision.policy import get_policy
from tests.helpers import reordered_rtol

SHAPES = [   # batch, length, heads, kv_heads, head_dim, flash block
    (2, 37, 4, 2, 16, 8),     # grouped, length not a multiple of the block
    (1, 64, 4, 4, 8, 16),     # plain multi-head, whole blocks
    (2, 5, 2, 1, 8, 512),     # shorter than one block
    (1, 130, 6, 2, 16, 32),   # odd length over several blocks
]


def _inputs(b, t, h, kv, d, dtype=jnp.float32):
  ks = jax.random.split(jax.random.PRNGKey(t * h + kv), 4)
  q = jax.random.normal(ks[0], (b, t, h, d))
  k = jax.random.normal(ks[1], (b, t, kv, d))
  v = jax.random.normal(ks[2], (b, t, kv, d))
  weights = jax.random.normal(ks[3], (b, t, h, d))   # a loss that reaches every output element
  return tuple(x.astype(dtype) for x in (q, k, v)), weights


def _value_and_grads(fn, qkv, weights):
  def loss(q, k, v):
    return jnp.sum(fn(q, k, v).astype(jnp.float32) * weights)
  return jax.jit(lambda qkv: (fn(*qkv), jax.grad(loss, argnums=(0, 1, 2))(*qkv)))(qkv)


def _bound(reference, rtol):
  return rtol * float(jnp.max(jnp.abs(reference.astype(jnp.float32)))) + 1e-30


@pytest.mark.parametrize('shape', SHAPES, ids=lambda s: 'x'.join(map(str, s)))
def test_flash_equals_xla_in_fp32(shape):
  b, t, h, kv, d, block = shape
  qkv, weights = _inputs(b, t, h, kv, d)
  ref_out, ref_grads = _value_and_grads(xla_attention, qkv, weights)
  out, grads = _value_and_grads(lambda q, k, v: flash_attention(q, k, v, block=block), qkv, weights)
  # The longest sums: a row of t probabilities times values, and a gradient over t positions.
  rtol = 4 * reordered_rtol(t * d)
  np.testing.assert_array_less(jnp.abs(out - ref_out), _bound(ref_out, rtol))
  for name, g, ref in zip('qkv', grads, ref_grads):
    assert jnp.max(jnp.abs(g - ref)) <= _bound(ref, rtol), f'd{name}'


@pytest.mark.parametrize('dtype', [jnp.bfloat16, jnp.float16], ids=['bf16', 'fp16'])
def test_flash_equals_xla_in_16_bits(dtype):
  b, t, h, kv, d, block = 2, 37, 4, 2, 16, 8
  qkv, weights = _inputs(b, t, h, kv, d, dtype)
  ref_out, ref_grads = _value_and_grads(xla_attention, qkv, weights)
  out, grads = _value_and_grads(lambda q, k, v: flash_attention(q, k, v, block=block), qkv, weights)
  assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
  # Both round the probabilities (forward) and the scores' gradient (backward) to the format before
  # a product, at different points: a few ulps of the largest value, 2**-(mantissa bits) each.
  ulp = float(jnp.finfo(dtype).eps)
  diff = jnp.max(jnp.abs(out.astype(jnp.float32) - ref_out.astype(jnp.float32)))
  assert diff <= _bound(ref_out, 4 * ulp)
  for name, g, ref in zip('qkv', grads, ref_grads):
    diff = jnp.max(jnp.abs(g.astype(jnp.float32) - ref.astype(jnp.float32)))
    assert diff <= _bound(ref, 16 * ulp), f'd{name}'


def test_fp16_scores_beyond_the_format_do_not_overflow():
  """q . k over 65504 (the fp16 maximum) before scaling: products accumulate in fp32."""
  b, t, h, kv, d = 1, 24, 2, 1, 64
  q = jnp.full((b, t, h, d), 40.0, jnp.float16)   # 40 * 40 * 64 = 102400 unscaled, 12800 scaled
  k = jnp.full((b, t, kv, d), 40.0, jnp.float16)
  v = jax.random.normal(jax.random.PRNGKey(0), (b, t, kv, d)).astype(jnp.float16)
  for fn in (xla_attention, lambda q, k, v: flash_attention(q, k, v, block=8)):
    out, grads = _value_and_grads(fn, (q, k, v), jnp.ones((b, t, h, d)))
    assert bool(jnp.all(jnp.isfinite(out))) and all(bool(jnp.all(jnp.isfinite(g))) for g in grads)


def test_causal_mask_holds_across_blocks():
  """Changing the keys and values after position p leaves every output up to p unchanged."""
  b, t, h, kv, d = 1, 40, 2, 1, 8
  (q, k, v), _ = _inputs(b, t, h, kv, d)
  p = 17
  k2 = k.at[:, p + 1:].set(100.0)
  v2 = v.at[:, p + 1:].set(-100.0)
  for fn in (xla_attention, lambda q, k, v: flash_attention(q, k, v, block=8)):
    np.testing.assert_array_equal(fn(q, k, v)[:, :p + 1], fn(q, k2, v2)[:, :p + 1])


def test_auto_picks_flash_on_cpu_and_cudnn_on_gpu_in_16_bits():
  assert resolve('auto', jnp.float32, 'cpu') == 'flash'
  assert resolve('auto', jnp.bfloat16, 'cpu') == 'flash'
  assert resolve('auto', jnp.bfloat16, 'gpu') == 'cudnn'
  assert resolve('auto', jnp.float32, 'gpu') == 'flash'
  assert resolve('xla', jnp.bfloat16, 'gpu') == 'xla'
  assert 'only on a GPU' in refusal('cudnn', jnp.bfloat16, 'cpu')
  assert 'bf16 or fp16' in refusal('cudnn', jnp.float32, 'gpu')
  assert refusal('cudnn', jnp.float16, 'gpu') is None and refusal('flash', jnp.float32, 'cpu') is None


def test_attend_dispatches_to_the_named_implementation():
  qkv, _ = _inputs(1, 9, 2, 1, 8)
  np.testing.assert_array_equal(attend(*qkv, 'xla'), xla_attention(*qkv))
  np.testing.assert_array_equal(attend(*qkv, 'flash'), flash_attention(*qkv))


def _tiny(**fields):
  cfg = ModelConfig(**{**presets.model('tiny'), **fields})
  model = Transformer(cfg, policy=get_policy('fp32'), rngs=nnx.Rngs(0))
  return cfg, *nnx.split(model)


def _same_loss_and_grads(cfg, graphdef, params, rows: int, field: str, reference, others,
                         rtol: float):
  """The mean loss and its gradients with `field` set to each of `others` are those with it set to
  `reference`, within `rtol` of the reference's largest value."""
  tokens = jax.random.randint(jax.random.PRNGKey(1), (rows, 50), 0, cfg.vocab_size)
  targets = jnp.roll(tokens, -1, axis=1)

  def loss(params, value):
    model = nnx.merge(graphdef, params)
    model.cfg = dataclasses.replace(cfg, **{field: value})
    return model.token_losses(tokens, targets).mean()

  value_and_grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  expected, expected_grads = value_and_grad(params, reference)
  for other in others:
    value, grads = value_and_grad(params, other)
    assert abs(float(value - expected)) <= rtol * float(expected), (field, other)
    for g, ref in zip(jax.tree.leaves(grads), jax.tree.leaves(expected_grads)):
      assert jnp.max(jnp.abs(g - ref)) <= _bound(ref, rtol), (field, other)


@pytest.mark.parametrize('tie', [True, False], ids=['tied', 'untied'])
def test_chunked_loss_equals_the_whole_sequence_loss(tie):
  cfg, graphdef, params = _tiny(tie_embeddings=tie, attention='xla')
  # 50 positions: seven whole chunks of 7 and a padded one. Each position's loss is computed
  # alone; only the sums over the 3 x 50 positions are reordered.
  _same_loss_and_grads(cfg, graphdef, params, 3, 'loss_chunk', 0, (7,), reordered_rtol(3 * 50))


def test_the_model_gives_the_same_logits_with_each_attention():
  _, graphdef, params = _tiny(attention='xla')
  tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 33), 0, 256)
  reference = _logits_with(graphdef, params, tokens, attention='xla')
  flash = _logits_with(graphdef, params, tokens, attention='flash')
  rtol = 4 * reordered_rtol(33 * 64)
  assert jnp.max(jnp.abs(flash - reference)) <= _bound(reference, rtol)


def _logits_with(graphdef, params, tokens, **fields):
  cfg = dataclasses.replace(nnx.merge(graphdef, params).cfg, **fields)
  model = Transformer(cfg, policy=get_policy('fp32'), rngs=nnx.Rngs(0))
  nnx.update(model, params)
  return model(tokens)


def test_bad_choices_are_refused_in_one_line():
  with pytest.raises(ValueError, match=r"model.attention='paged'; allowed: auto, xla, flash, cudnn"):
    ModelConfig(**{**presets.model('tiny'), 'attention': 'paged'})
  with pytest.raises(ValueError, match=r'model.loss_chunk=-8'):
    ModelConfig(**{**presets.model('tiny'), 'loss_chunk': -8})


@pytest.mark.parametrize('remat', ['none', 'full'])
def test_an_unrolled_layer_scan_equals_the_rolled_one(remat):
  """model.scan_unroll changes how XLA runs the blocks, not what they compute: 2 (an iteration of
  two blocks and a remainder of one) and 3 (unrolled) against 1. Each operation is the same;
  fused differently, a sum over at most mlp_dim terms may be reordered in each of three layers."""
  cfg, graphdef, params = _tiny(num_layers=3, attention='xla', remat=remat)
  _same_loss_and_grads(cfg, graphdef, params, 2, 'scan_unroll', 1, (2, 3),
                       3 * reordered_rtol(cfg.mlp_dim))


def test_a_scan_unroll_outside_the_depth_is_refused():
  for bad in (0, 3, True):
    with pytest.raises(ValueError, match=rf'model.scan_unroll={bad!r}; .* from 1 \(rolled\) to '
                                         r'model.num_layers=2'):
      ModelConfig(**{**presets.model('tiny'), 'scan_unroll': bad})
