"""Hugging Face config.json <-> our ModelConfig fields, for the architectures we convert.

Llama (LlamaForCausalLM) is our default options: RMSNorm, SwiGLU, RoPE, no biases. GPT-2
(GPT2LMHeadModel) is LayerNorm, tanh-GELU, learned positions, a bias on every projection.
An HF option our model does not implement is refused, never ignored: ignoring it would load
weights into a model that computes something else.
"""
import json
import os

from convert.errors import ConvertError
from models.config import ModelConfig

# Hugging Face architecture name -> (our name for it, its model_type).
SUPPORTED = {'LlamaForCausalLM': ('llama', 'llama'), 'GPT2LMHeadModel': ('gpt2', 'gpt2')}
_BY_ARCH = {arch: name for name, (arch, _) in SUPPORTED.items()}
_BY_MODEL_TYPE = {model_type: arch for arch, model_type in SUPPORTED.values()}

# The ModelConfig options that make each architecture (Llama takes any rope_scaling; GPT-2 none).
OPTIONS = {'llama': dict(norm='rms', mlp='swiglu', positions='rope', bias=False),
           'gpt2': dict(norm='layer', mlp='gelu', positions='learned', bias=True,
                        rope_scaling='none')}

LLAMA_ACTIVATIONS = ('silu', 'swish')                 # one function, two names in transformers
GPT2_ACTIVATIONS = ('gelu_new', 'gelu_pytorch_tanh')  # the tanh approximation, as our 'gelu' MLP
DTYPES = ('float32', 'bfloat16', 'float16')
ROPE_TYPES = ('default', 'llama3')   # 'default' is plain RoPE, our rope_scaling='none'
# A llama3 rope block's keys -> our ModelConfig fields.
LLAMA3_ROPE_KEYS = {'factor': 'rope_factor', 'low_freq_factor': 'rope_low_freq_factor',
                    'high_freq_factor': 'rope_high_freq_factor',
                    'original_max_position_embeddings': 'rope_original_max_len'}


def _supported_list() -> str:
  return ', '.join(f'{name} (model_type {model_type})'
                   for name, (_, model_type) in SUPPORTED.items())


def load_config(path: str) -> dict:
  try:
    with open(path) as f:
      config = json.load(f)
  except json.JSONDecodeError as e:
    raise ConvertError(f'{path} is not valid JSON ({e})') from None
  if not isinstance(config, dict):
    raise ConvertError(f'{path} holds a JSON {type(config).__name__}; a Hugging Face config is an '
                       f'object')
  return config


def architecture(config: dict, where: str) -> str:
  """'llama' or 'gpt2': from `architectures[0]`, or from `model_type` when none is named."""
  names = config.get('architectures') or []
  if names:
    if names[0] not in SUPPORTED:
      raise ConvertError(f'{where}: architecture {names[0]!r} is not supported; supported: '
                         f'{_supported_list()}')
    return SUPPORTED[names[0]][0]
  model_type = config.get('model_type')
  if model_type not in _BY_MODEL_TYPE:
    raise ConvertError(f'{where}: model_type {model_type!r} (and no architectures) is not '
                       f'supported; supported: {_supported_list()}')
  return _BY_MODEL_TYPE[model_type]


def _size(config: dict, key: str, where: str, default: int | None = None) -> int:
  """A positive integer size; None (or absent) takes `default`, and with no default is refused."""
  value = config.get(key)
  if value is None:
    if default is None:
      raise ConvertError(f'{where} has no {key!r}, which the model size needs')
    return default
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ConvertError(f'{where}: {key}={value!r}; it must be a positive integer')
  return value


def _refuse_unless(config: dict, key: str, default, allowed: tuple, where: str) -> None:
  value = config.get(key, default)
  if value not in allowed:
    raise ConvertError(f'{where}: {key}={value!r} is not supported; allowed: '
                       f'{", ".join(repr(a) for a in allowed)}')


def _rope_fields(config: dict, where: str) -> dict:
  """rope_theta and the rope_scaling fields. transformers 5 writes `rope_parameters: {rope_type,
  rope_theta, ...}`; 4.x wrote a top-level `rope_theta` and a `rope_scaling` dict (or null) with
  `rope_type` (or `type`) and the scaling numbers. Both are read; rope_parameters wins."""
  params = config.get('rope_parameters') or {}
  scaling = config.get('rope_scaling') or {}
  for key, value in (('rope_parameters', params), ('rope_scaling', scaling)):
    if not isinstance(value, dict):
      raise ConvertError(f'{where}: {key}={value!r}; expected an object with rope_type and '
                         f'rope_theta')
  block_name = 'rope_parameters' if params else 'rope_scaling'
  rope = {**scaling, **params}
  rope_type = rope.get('rope_type') or rope.get('type') or 'default'
  if rope_type not in ROPE_TYPES:
    # linear / dynamic / yarn / ... rescale the frequencies in ways our model does not compute.
    raise ConvertError(f'{where}: rope type {rope_type!r} is not supported; supported: '
                       f'{", ".join(repr(t) for t in ROPE_TYPES)}')
  fields = dict(rope_theta=float(rope.get('rope_theta', config.get('rope_theta', 10000.0))))
  if rope_type == 'default':
    return dict(fields, rope_scaling='none')
  for key, field in LLAMA3_ROPE_KEYS.items():
    if key not in rope:
      raise ConvertError(f"{where}: {block_name} has rope_type 'llama3' but no {key!r}, which "
                         f'that scaling needs')
    value = rope[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
      raise ConvertError(f'{where}: {block_name}.{key}={value!r}; it must be a number')
    fields[field] = value if field == 'rope_original_max_len' else float(value)
  return dict(fields, rope_scaling='llama3')


def _llama_fields(config: dict, where: str) -> dict:
  _refuse_unless(config, 'hidden_act', 'silu', LLAMA_ACTIVATIONS, where)
  _refuse_unless(config, 'attention_bias', False, (False,), where)
  _refuse_unless(config, 'mlp_bias', False, (False,), where)
  d_model = _size(config, 'hidden_size', where)
  heads = _size(config, 'num_attention_heads', where)
  return dict(
      vocab_size=_size(config, 'vocab_size', where), d_model=d_model,
      num_layers=_size(config, 'num_hidden_layers', where), num_heads=heads,
      num_kv_heads=_size(config, 'num_key_value_heads', where, heads),
      head_dim=_size(config, 'head_dim', where, d_model // heads),
      mlp_dim=_size(config, 'intermediate_size', where),
      max_seq_len=_size(config, 'max_position_embeddings', where),
      norm_eps=float(config.get('rms_norm_eps', 1e-6)),
      tie_embeddings=bool(config.get('tie_word_embeddings', False)),
      **_rope_fields(config, where), **OPTIONS['llama'])


def _gpt2_fields(config: dict, where: str) -> dict:
  _refuse_unless(config, 'activation_function', 'gelu_new', GPT2_ACTIVATIONS, where)
  _refuse_unless(config, 'scale_attn_weights', True, (True,), where)
  _refuse_unless(config, 'scale_attn_by_inverse_layer_idx', False, (False,), where)
  _refuse_unless(config, 'reorder_and_upcast_attn', False, (False,), where)
  _refuse_unless(config, 'add_cross_attention', False, (False,), where)
  # An untied GPT-2 head has no bias, but our bias=True model gives every projection one.
  _refuse_unless(config, 'tie_word_embeddings', True, (True,), where)
  d_model = _size(config, 'n_embd', where)
  heads = _size(config, 'n_head', where)
  if d_model % heads:
    raise ConvertError(f'{where}: n_embd={d_model} must be a multiple of n_head={heads}')
  return dict(
      vocab_size=_size(config, 'vocab_size', where), d_model=d_model,
      num_layers=_size(config, 'n_layer', where), num_heads=heads, num_kv_heads=heads,
      head_dim=d_model // heads, mlp_dim=_size(config, 'n_inner', where, 4 * d_model),
      max_seq_len=_size(config, 'n_positions', where),
      norm_eps=float(config.get('layer_norm_epsilon', 1e-5)), tie_embeddings=True,
      **OPTIONS['gpt2'])


def model_fields(config: dict, arch: str, where: str) -> dict:
  """ModelConfig fields (all but remat and init_std), checked by building a ModelConfig once."""
  fields = (_llama_fields if arch == 'llama' else _gpt2_fields)(config, where)
  try:
    ModelConfig(**fields)
  except ValueError as e:
    raise ConvertError(f'{where}: {e}') from None
  return fields


def arch_of(cfg: ModelConfig) -> str:
  """The Hugging Face architecture our model options make: 'llama' or 'gpt2'."""
  options = {name: getattr(cfg, name) for wanted in OPTIONS.values() for name in wanted}
  for arch, wanted in OPTIONS.items():
    if all(options[name] == value for name, value in wanted.items()):
      return arch
  have = ' '.join(f'{k}={v!r}' for k, v in options.items())
  need = '; '.join(f'{arch}: ' + ' '.join(f'{k}={v!r}' for k, v in wanted.items())
                   for arch, wanted in OPTIONS.items())
  raise ConvertError(f'model options {have} match no Hugging Face architecture; supported mixes: '
                     f'{need}')


def _export_rope(cfg: ModelConfig) -> dict:
  """The RoPE keys of a Llama config.json, in the transformers 5 form and the 4.x one."""
  if cfg.rope_scaling == 'none':
    return dict(rope_parameters={'rope_type': 'default', 'rope_theta': cfg.rope_theta},
                rope_theta=cfg.rope_theta)
  scaling = {key: getattr(cfg, field) for key, field in LLAMA3_ROPE_KEYS.items()}
  return dict(rope_parameters={'rope_type': 'llama3', 'rope_theta': cfg.rope_theta, **scaling},
              rope_theta=cfg.rope_theta, rope_scaling={'rope_type': 'llama3', **scaling})


def export_config(cfg: ModelConfig, dtype: str) -> dict:
  """The config.json transformers loads for our model (transformers 5 keys, plus the 4.x ones
  `torch_dtype`, `rope_theta` and `rope_scaling`, so older versions read it too)."""
  if dtype not in DTYPES:
    raise ConvertError(f'dtype={dtype!r}; allowed: {", ".join(DTYPES)}')
  arch = arch_of(cfg)
  if arch == 'llama':
    body = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=cfg.mlp_dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, hidden_act='silu',
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings, **_export_rope(cfg),
        attention_bias=False, mlp_bias=False, attention_dropout=0.0)
  else:
    if not cfg.tie_embeddings:
      raise ConvertError('model.tie_embeddings=False with GPT-2 options; GPT-2 ties its head to '
                         'the embedding (its head has no bias), allowed: True')
    if cfg.num_kv_heads != cfg.num_heads or cfg.head_dim * cfg.num_heads != cfg.d_model:
      raise ConvertError(f'GPT-2 needs num_kv_heads == num_heads and head_dim * num_heads == '
                         f'd_model; got num_kv_heads={cfg.num_kv_heads}, '
                         f'num_heads={cfg.num_heads}, head_dim={cfg.head_dim}, '
                         f'd_model={cfg.d_model}')
    # No dropout: our model has none, so the exported one trains like ours.
    body = dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.num_layers, n_head=cfg.num_heads,
        n_inner=cfg.mlp_dim, n_positions=cfg.max_seq_len, layer_norm_epsilon=cfg.norm_eps,
        activation_function='gelu_new', scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
        add_cross_attention=False, tie_word_embeddings=True,
        attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
  name = _BY_ARCH[arch]
  return dict(architectures=[name], model_type=SUPPORTED[name][1], **body, dtype=dtype,
              torch_dtype=dtype)


def write_config(config: dict, directory: str) -> str:
  path = os.path.join(directory, 'config.json')
  with open(path, 'w') as f:
    json.dump(config, f, indent=2, sort_keys=True)
    f.write('\n')
  return path
