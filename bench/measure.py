"""What the benchmarks measure the same way (no flags here: several benchmarks import it): the
compared shapes, the matmul and streaming rates a machine reaches, and random batches on the devices."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from train.setup import Setup

# The model and batch shapes bench/versus.py and bench/studies/pieces.py compare. `issue`: the
# shape of issue 29's table; `small`: the default preset (configs/presets.py) at its training shape.
SHAPES = {
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
  """`text` as the type of the config value at dotted `key` (as a --config.key=text flag parses it)."""
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


def matmul_flops_per_sec(size: int, dtype, repeats: int = 10) -> float:
  a = jnp.asarray(np.random.default_rng(0).normal(size=(size, size)), dtype)
  matmul = jax.jit(lambda x, y: x @ y)
  matmul(a, a).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    matmul(a, a).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 2 * size**3 / best


def streaming_bytes_per_sec(nbytes: float, repeats: int = 10) -> float:
  """Bytes per second that XLA moves through a plain elementwise op (x * 2 + 1 in fp32, reading
  and writing `nbytes` in all, in place): the rate a fusion of that size could reach on this
  machine. In place, so that no call pays for fresh pages of a new output buffer."""
  values = max(int(nbytes // 8), 1)
  x = jnp.ones((values,), jnp.float32)
  stream = jax.jit(lambda x: x * 2 + 1, donate_argnums=0)
  x = stream(x).block_until_ready()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    x = stream(x).block_until_ready()
    best = min(best, time.perf_counter() - start)
  return 8 * values / best


def bench_setup(config):
  """train.run.setup for a benchmark: with no accelerator, `host_devices` simulated CPU devices
  (as main.py); a mesh of fixed sizes on that many devices (one GPU of eight, say), one with -1 on
  all of them."""
  from train.run import setup
  if config.get('host_devices'):
    jax.config.update('jax_num_cpu_devices', config.host_devices)
  sizes = list(config.mesh.values())
  return setup(config, devices=None if -1 in sizes else jax.devices()[:int(np.prod(sizes))])


def random_batches(s: Setup, count: int) -> list[dict]:
  """`count` batches of random tokens on the devices, one document per row, with the keys the step
  was compiled for (with packing on, `segments` too: all one segment, which costs the same as
  several)."""
  from data.windows import batch_keys
  train = s.config.train
  rng = np.random.default_rng(0)
  batches = []
  for _ in range(count):
    tokens = rng.integers(0, s.model.vocab_size, (train.batch_size, train.seq_len + 1), np.int32)
    arrays = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
              'segments': np.ones((train.batch_size, train.seq_len), np.int32)}
    batches.append({k: jax.device_put(arrays[k], s.batch_sharding)
                    for k in batch_keys(s.config.data.packing)})
  return batches
