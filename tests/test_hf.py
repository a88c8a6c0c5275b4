"""Hugging Face import/export (convert/): logits match transformers after import and after a round
trip through export_hf and from_pretrained; every bad checkpoint or target is one clear line."""
import json
import os
import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

try:   # the reference: requirements-test.txt has them; a stack without them skips what needs them
  import torch
  from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig,
                            LlamaForCausalLM)
except ImportError:
  torch = None

from convert import ConvertError, HFCheckpoint, arch_of, export_hf
from models import ModelConfig, Transformer
from precision.policy import POLICIES

VOCAB, SEQ = 96, 32
TOLERANCE = 1e-4   # max |ours - hf| / max |hf|
ROPE_THETA = 500.0   # not Llama's 10000, so a converter that ignores it fails
HEAD_DIM = 16        # the Llama models': hidden_size 64 over 4 heads
# Llama 3 scaling, shrunk so that at HEAD_DIM and ROPE_THETA all three bands hold frequencies
# (test_llama3_rope_test_model_exercises_every_band); every number differs from its default.
LLAMA3_ROPE = {'rope_type': 'llama3', 'rope_theta': ROPE_THETA, 'factor': 8.0,
               'low_freq_factor': 0.5, 'high_freq_factor': 2.0,
               'original_max_position_embeddings': 16}


def _hf_model(kind: str) -> 'torch.nn.Module':
  torch.manual_seed(0)
  if kind == 'gpt2':
    config = GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=SEQ,
                        initializer_range=0.2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
  else:
    rope = LLAMA3_ROPE if kind == 'llama3' else {'rope_type': 'default', 'rope_theta': ROPE_THETA}
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=SEQ, rope_parameters=rope,
                         rms_norm_eps=1e-5, initializer_range=0.2,
                         tie_word_embeddings=kind == 'llama_tied')
    model = LlamaForCausalLM(config)
  with torch.no_grad():   # norms start at one and biases at zero: make them matter
    for p in model.parameters():
      p.add_(0.1 * torch.randn_like(p))
  return model.eval()


@pytest.fixture(scope='module')
def saved(tmp_path_factory):
  """kind -> a directory written by save_pretrained (safetensors), built on first use."""
  if torch is None:
    pytest.skip('needs torch and transformers (requirements-test.txt)')
  dirs = {}

  def get(kind: str) -> str:
    if kind not in dirs:
      dirs[kind] = str(tmp_path_factory.mktemp(kind))
      _hf_model(kind).save_pretrained(dirs[kind])
    return dirs[kind]
  return get


def _tokens() -> np.ndarray:
  return np.random.default_rng(0).integers(0, VOCAB, size=(2, SEQ), dtype=np.int32)


def _hf_logits(directory: str) -> np.ndarray:
  model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
  with torch.no_grad():
    return model(torch.from_numpy(_tokens()).long()).logits.numpy()


def _import(directory: str, **overrides):
  """(config, model, params) with the checkpoint's weights in our Transformer (fp32)."""
  checkpoint = HFCheckpoint(directory)
  cfg = ModelConfig(**{**checkpoint.model_fields(), **overrides})
  model = Transformer(cfg, policy=POLICIES['fp32'], rngs=nnx.Rngs(0))
  state = nnx.state(model, nnx.Param)
  params = checkpoint.read_all(nnx.to_pure_dict(state))
  nnx.replace_by_pure_dict(state, params)
  nnx.update(model, state)
  return cfg, model, params


def _relative_error(ours, hf) -> float:
  return float(np.max(np.abs(np.asarray(ours) - hf)) / np.max(np.abs(hf)))


def _raises(match: str, fn, *args, **kwargs) -> str:
  with pytest.raises(ConvertError, match=match) as error:
    fn(*args, **kwargs)
  assert '\n' not in str(error.value)
  return str(error.value)


def _copy(saved_dir: str, tmp_path) -> str:
  directory = str(tmp_path / 'copy')
  shutil.copytree(saved_dir, directory)
  return directory


def _edit_config(directory: str, **changes) -> None:
  path = os.path.join(directory, 'config.json')
  with open(path) as f:
    config = json.load(f)
  config.update(changes)
  config = {k: v for k, v in config.items() if v is not ...}   # `...` deletes a key
  with open(path, 'w') as f:
    json.dump(config, f)


# ---- parity -------------------------------------------------------------------------------------
@pytest.mark.parametrize('kind, shard_bytes', [('llama', 40_000), ('llama_tied', 5 * 10**9),
                                               ('llama3', 5 * 10**9), ('gpt2', 5 * 10**9)])
def test_logits_match_transformers_after_import_and_after_export(saved, tmp_path, kind,
                                                                  shard_bytes):
  directory = saved(kind)
  cfg, model, params = _import(directory)
  ours = model(jnp.asarray(_tokens()))
  imported = _relative_error(ours, _hf_logits(directory))
  print(f'\n{kind}: import max relative error {imported:.2e}')
  assert imported <= TOLERANCE

  out = tmp_path / 'exported'
  written = export_hf(params, cfg, out, shard_bytes=shard_bytes)
  sharded = os.path.join(out, 'model.safetensors.index.json') in written
  assert sharded == (shard_bytes < 5 * 10**9)
  assert HFCheckpoint(out).model_fields() == HFCheckpoint(directory).model_fields()
  exported = _relative_error(ours, _hf_logits(out))
  print(f'{kind}: export (sharded={sharded}) max relative error {exported:.2e}')
  assert exported <= TOLERANCE


def test_llama_fields_and_tied_head_come_from_the_config(saved):
  untied, tied = HFCheckpoint(saved('llama')), HFCheckpoint(saved('llama_tied'))
  assert untied.arch == tied.arch == 'llama'
  assert untied.model_fields()['rope_theta'] == ROPE_THETA
  assert (untied.model_fields()['num_heads'], untied.model_fields()['num_kv_heads']) == (4, 2)
  assert not untied.model_fields()['tie_embeddings'] and tied.model_fields()['tie_embeddings']


def test_rope_theta_changes_the_logits_so_parity_proves_it_was_read(saved):
  _, model, _ = _import(saved('llama'), rope_theta=10000.0)
  assert _relative_error(model(jnp.asarray(_tokens())), _hf_logits(saved('llama'))) > 1e-2


def test_llama3_rope_test_model_exercises_every_band():
  """Scaled (wavelength > original / low), kept (< original / high) and blended (between)."""
  inv_freq = ROPE_THETA ** (-np.arange(0, HEAD_DIM, 2) / HEAD_DIM)
  wavelength = 2 * np.pi / inv_freq
  original = LLAMA3_ROPE['original_max_position_embeddings']
  low_wavelength = original / LLAMA3_ROPE['low_freq_factor']
  high_wavelength = original / LLAMA3_ROPE['high_freq_factor']
  scaled = wavelength > low_wavelength
  kept = wavelength < high_wavelength
  assert scaled.any() and kept.any() and (~scaled & ~kept).any(), wavelength


def test_llama3_rope_fields_come_from_the_config_and_change_the_logits(saved):
  fields = HFCheckpoint(saved('llama3')).model_fields()
  assert (fields['rope_scaling'], fields['rope_theta'], fields['rope_factor'],
          fields['rope_low_freq_factor'], fields['rope_high_freq_factor'],
          fields['rope_original_max_len']) == ('llama3', ROPE_THETA, 8.0, 0.5, 2.0, 16)
  assert HFCheckpoint(saved('llama')).model_fields()['rope_scaling'] == 'none'
  _, model, _ = _import(saved('llama3'), rope_scaling='none')
  assert _relative_error(model(jnp.asarray(_tokens())), _hf_logits(saved('llama3'))) > 1e-2


def test_llama3_export_writes_both_config_forms(saved, tmp_path):
  cfg, _, params = _import(saved('llama3'))
  export_hf(params, cfg, tmp_path / 'out')
  with open(tmp_path / 'out' / 'config.json') as f:
    config = json.load(f)
  assert config['rope_parameters'] == LLAMA3_ROPE
  assert config['rope_scaling'] == {k: v for k, v in LLAMA3_ROPE.items() if k != 'rope_theta'}
  assert config['rope_theta'] == ROPE_THETA


def test_gpt2_options_with_rope_scaling_are_not_a_model(saved):
  fields = HFCheckpoint(saved('gpt2')).model_fields()
  with pytest.raises(ValueError, match="rope_scaling='llama3' scales rotary embeddings, but "
                                       "model.positions='learned'"):
    ModelConfig(**{**fields, 'rope_scaling': 'llama3'})


@pytest.mark.parametrize('kind', ['llama', 'llama3'])
def test_transformers_4_config_keys_give_the_same_fields(saved, tmp_path, kind):
  directory = _copy(saved(kind), tmp_path)
  scaling = None
  if kind == 'llama3':   # 4.x: `type` (older) or `rope_type`, the theta outside
    scaling = {'type': 'llama3', **{k: v for k, v in LLAMA3_ROPE.items()
                                    if k not in ('rope_type', 'rope_theta')}}
  _edit_config(directory, rope_parameters=..., rope_theta=ROPE_THETA, rope_scaling=scaling,
               dtype=..., torch_dtype='float32')
  assert HFCheckpoint(directory).model_fields() == HFCheckpoint(saved(kind)).model_fields()


def test_gpt2_names_without_prefix_and_with_mask_buffers_read_the_same(saved, tmp_path):
  """Older GPT-2 files (the hub's `gpt2`) have bare `h.0...` names and carry attn.bias buffers."""
  directory = _copy(saved('gpt2'), tmp_path)
  file = os.path.join(directory, 'model.safetensors')
  with safe_open(file, framework='numpy') as f:
    tensors = {name.removeprefix('transformer.'): f.get_tensor(name) for name in f.keys()}
  for i in range(2):
    tensors[f'h.{i}.attn.bias'] = np.tril(np.ones((1, 1, SEQ, SEQ), np.float32))
    tensors[f'h.{i}.attn.masked_bias'] = np.array(-1e4, np.float32)
  save_file(tensors, file, metadata={'format': 'pt'})
  _, model, _ = _import(saved('gpt2'))
  template = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  want = HFCheckpoint(saved('gpt2')).read_all(template)
  got = HFCheckpoint(directory).read_all(template)
  for (path, a), (_, b) in zip(_flat(want), _flat(got)):
    np.testing.assert_array_equal(a, b, err_msg='/'.join(path))


def _flat(tree, path=()):
  for key in sorted(tree):
    if isinstance(tree[key], dict):
      yield from _flat(tree[key], path + (key,))
    else:
      yield path + (key,), tree[key]


def test_bfloat16_export_is_read_back_as_the_rounded_weights(saved, tmp_path):
  cfg, _, params = _import(saved('llama'))
  export_hf(params, cfg, tmp_path / 'bf16', dtype='bfloat16')
  with open(tmp_path / 'bf16' / 'config.json') as f:
    assert json.load(f)['dtype'] == 'bfloat16'
  checkpoint = HFCheckpoint(tmp_path / 'bf16')
  back = checkpoint.read_all(params)
  as_bf16 = checkpoint.read(('blocks', 'attention', 'query', 'kernel'),
                            params['blocks']['attention']['query']['kernel'].shape, jnp.bfloat16)
  assert as_bf16.dtype == ml_dtypes.bfloat16
  for (path, a), (_, b) in zip(_flat(params), _flat(back)):
    np.testing.assert_array_equal(a.astype(ml_dtypes.bfloat16).astype(np.float32), b,
                                  err_msg='/'.join(path))


# ---- bad inputs ---------------------------------------------------------------------------------
@pytest.mark.parametrize('config', [
    {'architectures': ['MistralForCausalLM'], 'model_type': 'mistral'},
    {'architectures': ['BertModel'], 'model_type': 'bert'},
    {'model_type': 'bert'}])
def test_unsupported_architecture_names_the_supported_ones(tmp_path, config):
  (tmp_path / 'config.json').write_text(json.dumps(config))
  name = (config.get('architectures') or [config['model_type']])[0]
  message = _raises(name, HFCheckpoint, tmp_path)
  assert 'LlamaForCausalLM' in message and 'GPT2LMHeadModel' in message


def test_missing_directory_or_config_is_refused(tmp_path):
  _raises('is not a directory', HFCheckpoint, tmp_path / 'nowhere')
  _raises('has no config.json', HFCheckpoint, tmp_path)


def test_missing_safetensors_names_the_files_looked_for(saved, tmp_path):
  shutil.copy(os.path.join(saved('llama'), 'config.json'), tmp_path)
  message = _raises('model.safetensors', HFCheckpoint, tmp_path)
  assert 'model.safetensors.index.json' in message
  (tmp_path / 'pytorch_model.bin').write_bytes(b'')
  _raises('only safetensors are read', HFCheckpoint, tmp_path)


@pytest.mark.parametrize('kind, changes, message', [
    ('llama', dict(rope_parameters={'rope_type': 'linear', 'rope_theta': 5e5, 'factor': 8.0}),
     "rope type 'linear' is not supported; supported: 'default', 'llama3'"),
    ('llama', dict(rope_parameters=None, rope_scaling={'type': 'dynamic', 'factor': 2.0}),
     "rope type 'dynamic' is not supported; supported: 'default', 'llama3'"),
    ('llama3', dict(rope_parameters={k: v for k, v in LLAMA3_ROPE.items()
                                     if k != 'low_freq_factor'}),
     "rope_parameters has rope_type 'llama3' but no 'low_freq_factor'"),
    ('llama3', dict(rope_parameters={**LLAMA3_ROPE, 'factor': 0.5}),
     r"model\.rope_factor=0\.5 with rope_scaling='llama3'; it must be >= 1"),
    ('llama3', dict(rope_parameters={**LLAMA3_ROPE, 'high_freq_factor': 0.25}),
     'they must satisfy high_freq_factor > low_freq_factor > 0'),
    ('llama3', dict(rope_parameters={**LLAMA3_ROPE, 'factor': 'eight'}),
     r"rope_parameters\.factor='eight'; it must be a number"),
    ('llama', dict(hidden_act='gelu'), "hidden_act='gelu' is not supported"),
    ('llama', dict(attention_bias=True), 'attention_bias=True is not supported'),
    ('gpt2', dict(scale_attn_by_inverse_layer_idx=True), 'scale_attn_by_inverse_layer_idx=True'),
    ('gpt2', dict(activation_function='relu'), "activation_function='relu' is not supported"),
])
def test_config_options_we_do_not_implement_are_refused(saved, tmp_path, kind, changes, message):
  directory = _copy(saved(kind), tmp_path)
  _edit_config(directory, **changes)
  _raises(message, HFCheckpoint, directory)


def test_config_edited_to_another_size_names_the_tensor_and_both_shapes(saved, tmp_path):
  directory = _copy(saved('llama'), tmp_path)
  _edit_config(directory, intermediate_size=128)
  checkpoint = HFCheckpoint(directory)
  cfg = ModelConfig(**checkpoint.model_fields())
  model = nnx.eval_shape(lambda: Transformer(cfg, policy=POLICIES['fp32'], rngs=nnx.Rngs(0)))
  _raises(r"tensor 'model\.layers\.0\.mlp\.(gate|up|down)_proj\.weight' in .* has shape "
          r"\((96, 64|64, 96)\); .*config\.json expects \((128, 64|64, 128)\)",
          checkpoint.read_all, nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def test_missing_tensor_is_named(saved, tmp_path):
  directory = _copy(saved('llama'), tmp_path)
  file = os.path.join(directory, 'model.safetensors')
  with safe_open(file, framework='numpy') as f:
    tensors = {n: f.get_tensor(n) for n in f.keys()
               if n != 'model.layers.1.self_attn.v_proj.weight'}
  save_file(tensors, file, metadata={'format': 'pt'})
  checkpoint = HFCheckpoint(directory)
  _raises(r"'model\.layers\.1\.self_attn\.v_proj\.weight' is missing", checkpoint.read,
          ('blocks', 'attention', 'value', 'kernel'), (2, 64, 2, 16), np.float32)


def test_export_into_a_non_empty_directory_is_refused_and_leaves_it_untouched(saved, tmp_path):
  cfg, _, params = _import(saved('llama_tied'))
  out = tmp_path / 'mine'
  out.mkdir()
  (out / 'notes.txt').write_text('keep me')
  _raises('is not empty', export_hf, params, cfg, out)
  assert os.listdir(out) == ['notes.txt'] and (out / 'notes.txt').read_text() == 'keep me'


def test_export_refuses_an_options_mix_lora_leaves_and_unknown_dtypes(saved, tmp_path):
  cfg, _, params = _import(saved('llama_tied'))
  mixed = ModelConfig(**{**HFCheckpoint(saved('llama_tied')).model_fields(), 'mlp': 'gelu'})
  _raises("mlp='gelu'", arch_of, mixed)
  _raises('dtype=.int8.; allowed: float32, bfloat16, float16', export_hf, params, cfg,
          tmp_path / 'a', dtype='int8')
  with_lora = {**params, 'blocks': {**params['blocks'], 'attention': {
      **params['blocks']['attention'], 'query': {**params['blocks']['attention']['query'],
                                                 'lora': {'a': np.zeros((2, 64, 4))}}}}}
  _raises('merge the adapters', export_hf, with_lora, cfg, tmp_path / 'b')
  assert not os.path.exists(tmp_path / 'a') and not os.path.exists(tmp_path / 'b')
