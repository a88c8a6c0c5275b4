"""The decoder: causality, rotary embeddings, grouped-query attention, parameter bookkeeping."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.layers import Attention, apply_rope, rope_tables
from precision.policy import get_policy
from tests.helpers import random_tokens, split_params, tiny_model, tiny_model_config


def test_changing_a_future_token_never_changes_an_earlier_logit():
  _, model = tiny_model()
  tokens = random_tokens((2, 32))
  changed = tokens.copy()
  changed[:, 20] = (changed[:, 20] + 1) % 256
  logits = jax.jit(lambda t: model(t))   # one compile, not one per operation
  a, b = logits(jnp.asarray(tokens)), logits(jnp.asarray(changed))
  np.testing.assert_array_equal(a[:, :20], b[:, :20])
  assert not np.allclose(a[:, 20:], b[:, 20:])


def test_rope_tables_and_rotation_shapes():
  positions = jnp.broadcast_to(jnp.arange(10), (3, 10))
  cos, sin = rope_tables(positions, head_dim=16, theta=10000.0)
  assert cos.shape == sin.shape == (3, 10, 8)
  x = jnp.ones((3, 10, 4, 16))
  assert apply_rope(x, cos, sin).shape == x.shape


def test_rope_pairs_dimension_i_with_i_plus_half():
  """Llama's half-rotation layout: energy in dim 0 rotates into dim head_dim/2, nowhere else."""
  head_dim = 8
  x = jnp.zeros((1, 1, 1, head_dim)).at[..., 0].set(1.0)
  cos, sin = rope_tables(jnp.array([[3]]), head_dim, theta=10000.0)
  rotated = np.asarray(apply_rope(x, cos, sin))[0, 0, 0]
  np.testing.assert_allclose(rotated[0], np.cos(3.0), rtol=1e-6)
  np.testing.assert_allclose(rotated[head_dim // 2], np.sin(3.0), rtol=1e-6)
  others = np.delete(rotated, [0, head_dim // 2])
  np.testing.assert_allclose(others, 0.0, atol=1e-7)


def test_rope_scores_depend_only_on_relative_position():
  rng = np.random.default_rng(0)
  q, k = (jnp.asarray(rng.normal(size=(1, 1, 1, 16)), jnp.float32) for _ in range(2))

  def score(pq, pk):
    cq, sq = rope_tables(jnp.array([[pq]]), 16, 10000.0)
    ck, sk = rope_tables(jnp.array([[pk]]), 16, 10000.0)
    return float(jnp.sum(apply_rope(q, cq, sq) * apply_rope(k, ck, sk)))

  np.testing.assert_allclose(score(7, 3), score(104, 100), rtol=1e-4)


def test_grouped_query_attention_equals_attention_with_repeated_kv_heads():
  cfg = tiny_model_config()
  grouped_cfg = cfg.__class__(**{**cfg.__dict__, 'num_heads': 4, 'num_kv_heads': 2})
  full_cfg = cfg.__class__(**{**cfg.__dict__, 'num_heads': 4, 'num_kv_heads': 4})
  policy = get_policy('fp32')
  grouped = Attention(grouped_cfg, policy=policy, rngs=nnx.Rngs(0))
  full = Attention(full_cfg, policy=policy, rngs=nnx.Rngs(1))
  full.query.kernel[...] = grouped.query.kernel[...]
  full.out.kernel[...] = grouped.out.kernel[...]
  group = grouped_cfg.num_heads // grouped_cfg.num_kv_heads
  # Query head h reads KV head h // group: repeating each KV head `group` times gives the same map.
  full.key.kernel[...] = jnp.repeat(grouped.key.kernel[...], group, axis=1)
  full.value.kernel[...] = jnp.repeat(grouped.value.kernel[...], group, axis=1)
  x = jnp.asarray(np.random.default_rng(0).normal(size=(2, 12, cfg.d_model)), jnp.float32)
  cos, sin = rope_tables(jnp.broadcast_to(jnp.arange(12), (2, 12)), cfg.head_dim, cfg.rope_theta)
  attend = nnx.jit(lambda attention: attention(x, cos, sin))
  np.testing.assert_allclose(attend(grouped), attend(full), rtol=1e-5, atol=1e-6)
  assert grouped.key.kernel.shape == (cfg.d_model, 2, cfg.head_dim)


@pytest.mark.parametrize('tie', [True, False])
def test_parameter_count_matches_the_config_and_every_param_has_logical_axes(tie):
  cfg, model = tiny_model(tie_embeddings=tie)
  params = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == cfg.num_params
  for path, variable in jax.tree_util.tree_flatten_with_path(
      params, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]:
    axes = variable.get_metadata()['out_sharding']
    assert len(axes) == variable.ndim, path
    assert set(axes) <= {'vocab', 'embed', 'heads', 'kv_heads', 'head_dim', 'mlp', 'layers'}


def test_layers_are_stacked_on_a_leading_layers_axis():
  cfg, model = tiny_model()
  kernel = model.blocks.mlp.gate.kernel
  assert kernel.shape == (cfg.num_layers, cfg.d_model, cfg.mlp_dim)
  assert kernel.get_metadata()['out_sharding'][0] == 'layers'


def test_flops_per_token_counts_six_per_matmul_weight_plus_attention():
  cfg = tiny_model_config()
  matmul = cfg.num_layers * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer)
  matmul += cfg.vocab_size * cfg.d_model
  assert cfg.flops_per_token(64) == 6 * matmul + 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 64
  # The causal count (MaxText's): half the attention pairs, the weights' FLOPs unchanged.
  assert cfg.flops_per_token(64, causal=True) == 6 * matmul + 6 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 64


@pytest.mark.parametrize('remat', ['full', 'dots', 'qkv'])
def test_remat_policies_give_the_same_gradients(remat):
  tokens = jnp.asarray(random_tokens((2, 16)))

  def grads_of(model):
    graphdef, params = split_params(model)
    return jax.jit(jax.grad(lambda p: nnx.merge(graphdef, p)(tokens).mean()))(params)

  reference = grads_of(tiny_model()[1])
  rematted = grads_of(tiny_model(remat=remat)[1])
  for a, b in zip(jax.tree.leaves(reference), jax.tree.leaves(rematted)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize('tie', [True, False])
def test_bf16_logits_are_accumulated_in_fp32_not_rounded_to_bf16(tie):
  """The head's product of bf16 operands equals the fp32 product of the same operands to within
  fp32 summation error (d_model terms), far inside a bf16 rounding (2**-9 relative), which the
  logits would carry if the product were rounded to the compute dtype before the cast."""
  cfg, model = tiny_model('bf16_mixed', tie_embeddings=tie)
  tokens = random_tokens((2, 16))
  x, head = model.hidden(tokens)
  logits = head(x)
  kernel = (model.embedding[...].T if tie else model.head.kernel[...])
  reference = np.asarray(x, np.float32) @ np.asarray(kernel.astype(jnp.bfloat16), np.float32)
  assert logits.dtype == jnp.float32
  bound = cfg.d_model * 2.0**-24 * (np.abs(np.asarray(x, np.float32)) @
                                    np.abs(np.asarray(kernel.astype(jnp.bfloat16), np.float32)))
  assert np.all(np.abs(np.asarray(logits) - reference) <= bound + 1e-30)
  # The same logits rounded to bf16 break that bound: the test can tell the two apart.
  rounded = np.asarray(jnp.asarray(reference).astype(jnp.bfloat16), np.float32)
  assert np.any(np.abs(rounded - reference) > bound)


def test_the_heads_backward_takes_the_logits_gradient_in_the_compute_dtype():
  """quant/contraction.py:wide_product, as the tied head runs it: the logits are the plain
  product's, fp32; the backward
  rounds the logits' gradient to bf16 first (its gradients for g and for g rounded are the same,
  which the plain product's are not), and against a float64 reference its gradients are off by
  at most that rounding and the results' own (bf16's unit roundoff u = 2**-8 each) and fp32
  summation (n terms, n * 2**-24)."""
  from models.llama import TIED_HEAD_DIMS
  from quant.contraction import wide_product
  keys = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(keys[0], (2, 8, 32), jnp.float32).astype(jnp.bfloat16)
  table = jax.random.normal(keys[1], (64, 32), jnp.float32).astype(jnp.bfloat16)
  g = jax.random.normal(keys[2], (2, 8, 64), jnp.float32)
  rounded = g.astype(jnp.bfloat16).astype(jnp.float32)
  plain = lambda x, t: jnp.einsum('bld,vd->blv', x, t, preferred_element_type=jnp.float32)
  logits, vjp = jax.vjp(lambda x, t: wide_product(x, t, TIED_HEAD_DIMS), x, table)
  np.testing.assert_array_equal(logits, plain(x, table))
  dx, dtable = vjp(g)
  assert dx.dtype == x.dtype and dtable.dtype == table.dtype
  for a, b in zip((dx, dtable), vjp(rounded)):
    np.testing.assert_array_equal(a, b)
  _, plain_vjp = jax.vjp(plain, x, table)
  assert any(np.any(a != b) for a, b in zip(plain_vjp(g), plain_vjp(rounded)))
  u = 2.0**-8
  x64, t64, g64 = (np.asarray(a, np.float64) for a in (x, table, g))
  for got, exact, magnitude, n in [
      (dx, g64 @ t64, np.abs(g64) @ np.abs(t64), 64),
      (dtable, np.einsum('blv,bld->vd', g64, x64),
       np.einsum('blv,bld->vd', np.abs(g64), np.abs(x64)), 16)]:
    summed = (u + n * 2.0**-24 * (1 + u)) * magnitude   # the product's error before its rounding
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= summed + u * (np.abs(exact) + summed))


def test_the_gpus_cross_entropy_is_optaxs_within_fp32_summation():
  """models/loss.py:cross_entropy off the CPU picks the target's logit by a mask, not a gather: its
  losses and gradients are optax's (one exact pick; the softmax the same) up to fp32's summation
  over the vocabulary (n * 2**-24 of the sum of magnitudes); a pick of the next target's logit
  instead would not be (the test can tell a wrong pick)."""
  import optax
  from models.attention import compiling_for
  from models.loss import cross_entropy
  keys = jax.random.split(jax.random.key(0), 2)
  logits = 4 * jax.random.normal(keys[0], (3, 5, 1000), jnp.float32)
  targets = jax.random.randint(keys[1], (3, 5), 0, 1000)
  total = lambda f: lambda l: f(l, targets).sum()
  reference = jax.value_and_grad(total(optax.softmax_cross_entropy_with_integer_labels))(logits)
  with compiling_for('gpu'):
    masked = jax.value_and_grad(total(cross_entropy))(logits)
  n, eps = logits.shape[-1], 2.0**-24
  # Per loss: the normalizer's sum over n terms (n * eps, in the log) and a few roundings of
  # values as large as the largest loss; summed over the losses.
  largest_loss = float(jnp.abs(logits).max()) + np.log(n)
  np.testing.assert_allclose(masked[0], reference[0], rtol=0,
                             atol=targets.size * (n * eps + 4 * eps * largest_loss))
  assert np.abs(np.asarray(masked[1] - reference[1])).max() <= n * eps
  wrong = jax.grad(lambda l: optax.softmax_cross_entropy_with_integer_labels(
      l, (targets + 1) % n).sum())(logits)
  assert np.abs(np.asarray(masked[1] - wrong)).max() > 0.5


@pytest.mark.parametrize('scale_dtype', [jnp.float32, jnp.bfloat16])
def test_rms_norm_keeps_its_input_and_a_number_per_row_and_differentiates_within_rounding(
    capsys, scale_dtype):
  """models/rmsnorm.py: the forward is the plain norm's bit for bit; the backward keeps the input
  as it came and one fp32 number per row (autodiff's keeps fp32 [rows, d] values as well), and its
  gradients, formed in fp32, are within their rounding to bf16 (u = 2**-8; an fp32 scale's
  gradient is not rounded) and fp32's of a float64 reference: the row's mean square (d
  operations of 2**-24) enters the gradient three times through r, the sums over the row and over
  the rows add d + rows more."""
  from jax.ad_checkpoint import print_saved_residuals
  from models.rmsnorm import normalize, rms_norm
  rows, d, eps = 6, 64, 1e-5
  keys = jax.random.split(jax.random.key(1), 3)
  x, g = (jax.random.normal(k, (rows, d), jnp.float32).astype(jnp.bfloat16) * 3 for k in keys[:2])
  scale = (1 + 0.5 * jax.random.normal(keys[2], (d,), jnp.float32)).astype(scale_dtype)
  custom = lambda x, scale: rms_norm(x, scale, eps, jnp.bfloat16)
  plain = lambda x, scale: normalize(x, scale, eps, jnp.bfloat16)[0]
  np.testing.assert_array_equal(custom(x, scale), plain(x, scale))
  def saved(f):
    print_saved_residuals(f, x, scale)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert len(saved(custom)) == 3 and sum('argument' in line for line in saved(custom)) == 2
  assert any(f'f32[{rows},1]' in line for line in saved(custom))
  assert any(f'f32[{rows},{d}]' in line for line in saved(plain))
  x64, g64, s64 = (np.asarray(a, np.float64) for a in (x, g, scale))
  r = 1 / np.sqrt((x64 * x64).mean(-1, keepdims=True) + eps)
  n, gs = x64 * r, g64 * s64
  exact_x = r * (gs - n * (gs * n).mean(-1, keepdims=True))
  magnitude_x = r * (np.abs(gs) + np.abs(n) * np.abs(gs * n).mean(-1, keepdims=True))
  bound_x = 2.0**-8 * np.abs(exact_x) + (3 * d + 10) * 2.0**-24 * magnitude_x * (1 + 2.0**-8)
  exact_scale, magnitude_scale = (g64 * n).sum(0), np.abs(g64 * n).sum(0)
  rounding = 2.0**-8 if scale_dtype == jnp.bfloat16 else 0.0
  bound_scale = (rounding * np.abs(exact_scale)
                 + (rows + d + 10) * 2.0**-24 * magnitude_scale * (1 + rounding))
  # The plain norm's gradients are the same function: both within the same bounds.
  for norm in (custom, plain):
    d_x, d_scale = jax.vjp(norm, x, scale)[1](g)
    assert d_x.dtype == jnp.bfloat16 and d_scale.dtype == scale_dtype
    assert np.all(np.abs(np.asarray(d_x, np.float64) - exact_x) <= bound_x)
    assert np.all(np.abs(np.asarray(d_scale, np.float64) - exact_scale) <= bound_scale)


def test_swiglu_keeps_only_its_inputs_and_differentiates_within_bf16s_rounding(capsys):
  """models/swiglu.py: the forward is the plain product's bit for bit; the backward keeps the gate
  and up alone (autodiff's keeps three more [tokens, mlp_dim] values) and its gradients, formed in
  fp32 and rounded once to bf16, are within that rounding (u = 2**-8) and fp32's (a dozen
  operations, 2**-24 each) of a float64 reference."""
  from jax.ad_checkpoint import print_saved_residuals
  from models.swiglu import swiglu
  keys = jax.random.split(jax.random.key(0), 3)
  gate, up, g = (jax.random.normal(k, (4, 64), jnp.float32).astype(jnp.bfloat16) * 3 for k in keys)
  plain = lambda gate, up: jax.nn.silu(gate) * up
  np.testing.assert_array_equal(swiglu(gate, up), plain(gate, up))
  def saved(f):
    print_saved_residuals(f, gate, up)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert len(saved(swiglu)) == 2 and all('argument' in line for line in saved(swiglu))
  assert len(saved(plain)) == 5
  d_gate, d_up = jax.vjp(swiglu, gate, up)[1](g)
  assert d_gate.dtype == d_up.dtype == jnp.bfloat16
  x, u, g64 = (np.asarray(a, np.float64) for a in (gate, up, g))
  s = 1 / (1 + np.exp(-x))
  for got, exact, magnitude in [(d_gate, g64 * u * s * (1 + x * (1 - s)),
                                 np.abs(g64 * u * s) * (1 + np.abs(x) * (1 - s))),
                                (d_up, g64 * x * s, np.abs(g64 * x * s))]:
    bound = 2.0**-8 * np.abs(exact) + 12 * 2.0**-24 * magnitude * (1 + 2.0**-8)
    assert np.all(np.abs(np.asarray(got, np.float64) - exact) <= bound)


def test_a_dense_product_casting_its_weight_again_keeps_no_cast_and_computes_the_same(capsys):
  """models/dense.py:weight_casts_recomputed: a kernel stored in fp32 and multiplied in bf16 is
  not kept in bf16 for the backward (autodiff keeps the cast it multiplied by); the product's
  backward casts the stored kernel again, so the output and both gradients are the plain
  product's bit for bit. Weights stored split for ZeRO-3 to gather keep their casts."""
  from jax.ad_checkpoint import print_saved_residuals
  from models.dense import Dense, weight_casts_recomputed
  from models.hints import weights_split_over_data
  dense = Dense(64, (4, 16), axes=('embed', 'heads', 'head_dim'), init_std=0.02,
                policy=get_policy('bf16_mixed'), rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(dense)
  x = jax.random.normal(jax.random.key(1), (3, 64), jnp.float32)
  g = jax.random.normal(jax.random.key(2), (3, 4, 16), jnp.float32).astype(jnp.bfloat16)

  def product(recast, gathered=False):
    def f(x, state):
      with (weights_split_over_data(gathered),
            weight_casts_recomputed(False) if recast else contextlib.nullcontext()):
        return nnx.merge(graphdef, state)(x)
    return f

  def saved(f):
    print_saved_residuals(f, x, state)
    return [line for line in capsys.readouterr().out.splitlines() if line.strip()]
  assert any('bf16[64,4,16]' in line for line in saved(product(False)))
  assert not any('bf16[64,4,16]' in line for line in saved(product(True)))
  assert any('bf16[64,4,16]' in line for line in saved(product(True, gathered=True)))
  results = [(y, *vjp(g)) for y, vjp in (jax.vjp(product(r), x, state) for r in (False, True))]
  for plain, recast in zip(*(jax.tree.leaves(r) for r in results)):
    np.testing.assert_array_equal(plain, recast)
