"""Benchmark: tokens/s and model-FLOPs utilisation (MFU) of the train step, and its compiled memory.

MFU here is measured against the matrix-multiply rate this same machine reaches in this same run
(a large square matmul in the step's compute dtype), not against a datasheet peak: on a CPU there
is no datasheet figure worth quoting, and the measured rate is the ceiling the step could reach.

  python -m bench.train_step                                  # the default config and shape
  python -m bench.train_step --config=configs/default.py:tiny --steps=20
  python -m bench.train_step --config.precision=bf16_mixed    # any config override
"""
import json
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].')
_STEPS = flags.DEFINE_integer('steps', 30, 'Timed steps (after 3 warm-up steps).')
_MATMUL = flags.DEFINE_integer('matmul_size', 2048, 'Side of the square matmul that measures the peak.')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')


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


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from data.windows import batch_keys
  from memory.compiled import GiB
  from train import init_from
  from train.run import compile_train_step, memory_report, setup

  config = _CONFIG.value
  if config.get('host_devices'):   # as main.py: with no accelerator, simulate that many devices
    jax.config.update('jax_num_cpu_devices', config.host_devices)
  s = setup(config)
  compiled = compile_train_step(s)
  memory = memory_report(s, compiled)
  train = config.train
  rng = np.random.default_rng(0)

  def batch():
    # Random tokens, one document per row; the keys the step was compiled for (with packing on,
    # `segments` too: all one segment, which costs the same as several).
    tokens = rng.integers(0, s.model.vocab_size, (train.batch_size, train.seq_len + 1), np.int32)
    arrays = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
              'segments': np.ones((train.batch_size, train.seq_len), np.int32)}
    return {k: jax.device_put(arrays[k], s.batch_sharding)
            for k in batch_keys(config.data.packing)}

  state = init_from.fresh_state(s)   # a frozen base (LoRA, QLoRA) drawn a layer at a time
  for _ in range(3):
    state, metrics = compiled(state, batch())
  jax.block_until_ready(metrics)
  batches = [batch() for _ in range(_STEPS.value)]
  start = time.perf_counter()
  for b in batches:
    state, metrics = compiled(state, b)
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - start) / _STEPS.value

  tokens_per_sec = train.batch_size * train.seq_len / seconds
  # Per device, against one device's matmul rate.
  model_flops = s.model.flops_per_token(train.seq_len) * tokens_per_sec / jax.device_count()
  peak = matmul_flops_per_sec(_MATMUL.value, s.policy.compute_dtype)
  results = {
      'config': config.name, 'precision': s.policy.name, 'devices': jax.device_count(),
      'platform': jax.devices()[0].platform, 'batch_size': train.batch_size, 'seq_len': train.seq_len,
      'num_params': s.model.num_params, 'step_seconds': seconds, 'tokens_per_sec': tokens_per_sec,
      'model_flops_per_sec': model_flops, 'matmul_flops_per_sec': peak, 'mfu': model_flops / peak,
      'per_device_bytes': memory['per_device_bytes'], 'estimate_bytes': memory['estimate_bytes'],
  }
  print(f'{config.name} ({s.policy.name}, {jax.device_count()} x {results["platform"]}), '
        f'batch {train.batch_size} x {train.seq_len} tokens, {s.model.num_params / 1e6:.2f} M params')
  print(f'  step time          {seconds * 1e3:.1f} ms')
  print(f'  throughput         {tokens_per_sec:,.0f} tokens/s')
  print(f'  model FLOPs        {model_flops / 1e9:.2f} GFLOP/s per device '
        f'({s.model.flops_per_token(train.seq_len) / 1e6:.2f} MFLOP/token)')
  print(f'  matmul rate        {peak / 1e9:.2f} GFLOP/s ({_MATMUL.value}^2 {jnp.dtype(s.policy.compute_dtype).name} matmul, best of 10)')
  print(f'  MFU                {100 * results["mfu"]:.1f} % of the measured matmul rate')
  compiled_bytes = memory['per_device_bytes']
  print(f'  compiled memory    {compiled_bytes["total"] / GiB:.3f} GiB per device (arguments '
        f'{compiled_bytes["arguments"] / GiB:.3f}, outputs {compiled_bytes["outputs"] / GiB:.3f}, '
        f'aliased {compiled_bytes["aliased"] / GiB:.3f}, temp {compiled_bytes["temp"] / GiB:.3f})')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  app.run(main)
