"""LoRA and QLoRA: a frozen base (bit-identical after training, no gradients or optimizer state),
merged and reference logits, the quantized base's bytes and its sharding under ZeRO-3."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from models.dense import stored_bytes
from models.lora import LoraSpec, merge
from precision.policy import POLICIES
from tests.helpers import random_tokens, tiny_config
from train import checks, run
from train.state import ModelSpec

LORA = {'lora.rank': 4, 'lora.alpha': 8.0}


def batch_of(rows=8, seq_len=64, seed=0):
  tokens = random_tokens((rows, seq_len + 1), seed)
  return {'inputs': jnp.asarray(tokens[:, :-1]), 'targets': jnp.asarray(tokens[:, 1:])}


def train(config, steps=3, devices=1, distinct_batches=3):
  s = run.setup(config, devices=jax.devices()[:devices])
  state = s.layout.init()
  first = jax.tree.map(np.asarray, state)
  losses = []
  with s.context():
    for i in range(steps):
      batch = jax.device_put(batch_of(seed=i % distinct_batches), s.batch_sharding)
      state, metrics = s.train_step(state, batch)
      losses.append(float(metrics['loss']))
  return s, first, state, losses


def test_the_frozen_base_is_bit_identical_after_training_and_the_adapters_move():
  s, before, after, _ = train(tiny_config(**LORA))
  frozen_before, frozen_after = before['frozen'], jax.tree.map(np.asarray, after['frozen'])
  assert jax.tree.structure(frozen_before) == jax.tree.structure(frozen_after)
  for a, b in zip(jax.tree.leaves(frozen_before), jax.tree.leaves(frozen_after)):
    np.testing.assert_array_equal(a, b)
  moved = [not np.array_equal(a, np.asarray(b)) for a, b in
           zip(jax.tree.leaves(before['params']), jax.tree.leaves(after['params']))]
  assert all(moved)


def test_only_adapters_are_trained_and_have_optimizer_state():
  s = run.setup(tiny_config(**LORA), devices=jax.devices()[:1])
  abstract = s.layout.abstract
  param_paths = [jax.tree_util.keystr(p) for p, _ in
                 jax.tree_util.tree_flatten_with_path(abstract['params'])[0]]
  assert param_paths and all("['lora']" in p for p in param_paths)
  trainable = sum(x.size for x in jax.tree.leaves(abstract['params']))
  moments = sum(x.size for x in jax.tree.leaves(abstract['opt_state']) if x.ndim)
  assert moments == 2 * trainable   # Adam's two moments of the adapters, nothing of the base
  # rank 4 on query [64 -> 4x16] and value [64 -> 2x16] in 2 layers
  assert trainable == 2 * (4 * (64 + 64) + 4 * (64 + 32))


def test_compiled_step_arguments_shrink_to_the_frozen_base_plus_adapter_state():
  def argument_bytes(config):
    s = run.setup(config, devices=jax.devices()[:1])
    return run.compile_train_step(s).memory_analysis().argument_size_in_bytes, s

  full, s_full = argument_bytes(tiny_config())
  lora, s_lora = argument_bytes(tiny_config(**LORA))
  n = s_full.model.num_params
  trainable, frozen = s_lora.spec.sizes()
  batch = 3 * 8 * 64 * 4   # inputs, targets and segments (packed rows), int32
  # Full fine-tuning: weights + two moments of every parameter; LoRA: the frozen base once, and
  # weights + two moments of the adapters only.
  assert abs(full - (3 * n * 4 + batch)) < 1024
  assert abs(lora - (frozen + 3 * trainable * 4 + batch)) < 1024
  assert lora < 0.4 * full


def _model(spec: ModelSpec, b_scale=0.5):
  """The spec's model with nonzero B matrices (a fresh adapter is exactly zero)."""
  model = spec.build()
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == 'b':
      var[...] = b_scale * jax.random.normal(jax.random.PRNGKey(len(path)), var[...].shape)
  return model


@pytest.mark.parametrize('base_format', [None, 'nf4'])
def test_merged_logits_equal_the_adapted_logits(base_format):
  cfg = checks.model_config(tiny_config())
  spec = ModelSpec(cfg, POLICIES['fp32'], 0, LoraSpec(4, 8.0, targets='.*'), base_format)
  model = _model(spec)
  tokens = random_tokens((2, 16))
  logits = nnx.jit(lambda model: model(tokens))   # a compile per model, not per operation
  adapted = np.asarray(logits(model))
  merged = merge(model)
  assert not nnx.state(merged, nnx.LoRAParam)
  np.testing.assert_allclose(np.asarray(logits(merged)), adapted, rtol=2e-5, atol=2e-5)


def test_a_specs_abstract_model_is_what_it_builds_traced_once(monkeypatch):
  """ModelSpec.abstract: the shapes `build` makes (QLoRA's quantized parts included), a new module
  each call (a caller may change its own), from one trace of `build` per spec."""
  from train import state
  spec = ModelSpec(checks.model_config(tiny_config()), POLICIES['bf16_mixed'], 0, LoraSpec(4, 8.0),
                   'nf4')
  params, frozen = jax.eval_shape(lambda: spec.split(spec.build())[1:])
  shapes = lambda tree: jax.tree.map(lambda x: (x.shape, x.dtype), tree)
  builds, build = [], ModelSpec.build
  monkeypatch.setattr(ModelSpec, 'build', lambda self, *a, **k: builds.append(1) or build(self))
  state._abstract_split.cache_clear()
  with jax.set_mesh(jax.make_mesh((len(jax.devices()),), ('fsdp',))):
    first = spec.abstract()   # the first trace, under a mesh: its placement is not kept
  second = spec.abstract()
  assert {x.sharding for x in jax.tree.leaves(nnx.state(second))} == {None}
  assert shapes(spec.abstract_parts()) == shapes((params, frozen))
  assert spec.sizes() == (sum(x.size for x in jax.tree.leaves(params)),
                          sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(frozen)))
  assert first is not second and len(builds) == 1


def test_a_merge_keeps_an_update_below_half_a_bf16_step_of_a_bf16_base():
  """The export's merge is computed in fp32 and stored in the export's dtype: a bf16 base's kernel
  plus an update far below half its bf16 step comes out exactly as their fp32 sum."""
  cfg = checks.model_config(tiny_config())
  spec = ModelSpec(cfg, POLICIES['bf16'], 0, LoraSpec(4, 8.0, targets='.*'), None)
  model = _model(spec, b_scale=1e-6)
  dense = model.blocks.mlp.down
  base, update = dense.kernel[...], dense.lora.update()
  assert base.dtype == jnp.bfloat16
  # Below half a bf16 step (2**-8 of each kernel entry's magnitude) nearly everywhere.
  assert np.mean(np.abs(update) < np.abs(base.astype(jnp.float32)) * 2.0**-9) > 0.9
  merge(model, jnp.float32)
  merged = model.blocks.mlp.down.kernel[...]
  assert merged.dtype == jnp.float32
  np.testing.assert_array_equal(merged, base.astype(jnp.float32) + update)
  assert np.mean(merged != base.astype(jnp.float32)) > 0.9   # rounded to bf16, nearly none would move


def test_reference_logits_come_from_the_same_pass_with_adapters_off():
  cfg = checks.model_config(tiny_config())
  spec = ModelSpec(cfg, POLICIES['fp32'], 0, LoraSpec(4, 8.0))
  model = _model(spec)
  base = ModelSpec(cfg, POLICIES['fp32'], 0).build()   # same seed: the same base weights
  tokens = random_tokens((2, 16))
  active, reference = model(tokens, reference=True)
  np.testing.assert_allclose(np.asarray(reference), np.asarray(base(tokens)), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(active), np.asarray(model(tokens)), rtol=1e-6, atol=1e-6)
  assert np.abs(np.asarray(active) - np.asarray(reference)).max() > 1e-3


def test_dropout_masks_only_while_training():
  cfg = checks.model_config(tiny_config())
  model = _model(ModelSpec(cfg, POLICIES['fp32'], 0, LoraSpec(4, 8.0, dropout=0.5)))
  tokens = random_tokens((2, 16))
  plain = np.asarray(model(tokens))
  key = jax.random.PRNGKey(3)
  dropped = np.asarray(model(tokens, dropout_key=key))
  assert np.abs(dropped - plain).max() > 1e-4
  np.testing.assert_array_equal(dropped, np.asarray(model(tokens, dropout_key=key)))


def test_qlora_base_is_half_a_byte_per_weight_plus_scales():
  cfg = checks.model_config(tiny_config(**{'model.d_model': 128, 'model.mlp_dim': 256}))
  model = ModelSpec(cfg, POLICIES['bf16_mixed'], 0, LoraSpec(4, 8.0), 'nf4').abstract()   # shapes
  kernels = cfg.num_layers * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer)
  per_weight = stored_bytes(model)['quantized'] / kernels
  assert 0.5 < per_weight < 0.53, per_weight   # 4-bit codes + 8-bit block scales + fp32 per 256


@pytest.mark.parametrize('base_format', ['nf4', 'int8'])
def test_qlora_under_zero3_matches_one_device_and_shards_the_base(base_format):
  overrides = {**LORA, 'quant.weights': base_format, 'precision': 'bf16_mixed',
               'model.d_model': 128, 'model.mlp_dim': 256}
  _, _, _, single = train(tiny_config(**overrides))
  s, _, state, sharded = train(tiny_config(**overrides, **{
      'mesh.data': 1, 'mesh.fsdp': 8, 'parallel.zero_stage': 3}), devices=8)
  np.testing.assert_allclose(sharded, single, rtol=2e-3)
  codes = state['frozen']['blocks']['mlp']['up']['kernel']['codes']
  shard = codes.addressable_shards[0].data
  assert shard.size * 8 == codes.size   # each device holds an eighth of the quantized base


def test_loss_falls_with_lora():
  _, _, _, losses = train(tiny_config(**{**LORA, 'lora.alpha': 32.0,
                                         'train.learning_rate': 1e-2}), steps=12,
                          distinct_batches=1)
  assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.05, losses


@pytest.mark.parametrize('overrides, message', [
    ({**LORA, 'lora.targets': 'nothing/here'}, 'matches no dense layer; the model has blocks/'),
    ({'quant.weights': 'nf4'}, 'set lora.rank > 0'),
    ({**LORA, 'quant.weights': 'fp4'}, "quant.weights='fp4'; allowed: none, int8, int4, nf4"),
    ({'lora.rank': -1}, 'lora.rank=-1'),
    ({**LORA, 'lora.dropout': 1.0}, r'lora.dropout=1.0; it must be in \[0, 1\)'),
    ({**LORA, 'lora.targets': '(('}, 'is not a regular expression'),
    ({**LORA, 'quant.mode': 'int4', 'quant.learned_scale': True}, 'quant.learned_scale'),
])
def test_bad_lora_settings_are_refused_before_compiling(overrides, message):
  with pytest.raises(checks.ConfigError, match=message):
    checks.model_spec(tiny_config(**overrides))
