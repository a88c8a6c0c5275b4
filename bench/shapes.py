"""The model and batch shapes the benchmarks compare, and how our config is made one of them.
No JAX here: bench/versus.py's driver and its PyTorch workers import it without paying for JAX."""

# The model and batch shapes bench/versus.py and bench/studies/pieces.py compare. `issue`: the
# shape of issue 29's table; `small`: the default preset (configs/presets.py) at its training shape;
# `tiny`: the tiny preset at its own, to see in seconds that every program runs (its times say
# little: the step is a few milliseconds of work).
SHAPES = {
    'tiny': dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, mlp_dim=192, tie_embeddings=True, batch_size=8, seq_len=64),
    'issue': dict(vocab_size=256, d_model=256, num_layers=4, num_heads=4, num_kv_heads=4,
                  head_dim=64, mlp_dim=1024, tie_embeddings=False, batch_size=8, seq_len=256),
    'small': dict(vocab_size=256, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                  head_dim=32, mlp_dim=768, tie_embeddings=True, batch_size=16, seq_len=128),
    # Llama-3.2-1B's shapes (our 1b preset) at issue 47's batch: a GPU's shape.
    '1b': dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               head_dim=64, mlp_dim=8192, tie_embeddings=True, batch_size=8, seq_len=2048),
}

MODEL_KEYS = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
              'mlp_dim', 'tie_embeddings')


def our_overrides(spec: dict) -> list[str]:
  """--config.* flags that make configs/default.py:small the compared model and batch."""
  flags_ = [f'--config.model.{k}={spec[k]}' for k in MODEL_KEYS]
  flags_.append(f'--config.model.max_seq_len={max(spec["seq_len"], 512)}')
  flags_ += [f'--config.train.batch_size={spec["batch_size"]}',
             f'--config.train.seq_len={spec["seq_len"]}',
             f'--config.precision={spec["ours_precision"]}',
             f'--config.data.packing={spec["packing"]}',
             f'--config.model.attention={spec["attention"]}']
  return flags_ + [f'--config.{o}' for o in spec['overrides']]


def typed(config, key: str, text: str):
  """`text` as the type of the config value at dotted `key` (as --config.key=text parses it)."""
  node = config
  for part in key.split('.'):
    node = node[part]
  if isinstance(node, bool):
    return text == 'True'
  return type(node)(text)


def our_config(spec: dict):
  """configs/default.py:small made the compared model and batch, as `our_overrides` says."""
  import configs
  from configs.default import override
  config = configs.load('configs/default.py:small')
  for flag in our_overrides(spec):
    key, value = flag[len('--config.'):].split('=', 1)
    override(config, key, typed(config, key, value))
  return config
