"""What the benchmarks measure the same way (no flags here: several benchmarks import it): the
matmul and streaming rates a machine reaches, and random batches on the devices (the compared shapes
are bench/shapes.py's)."""
import time

import jax
import jax.numpy as jnp
import numpy as np

from train.setup import Setup


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
