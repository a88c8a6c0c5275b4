"""Benchmark: tokens/s and model-FLOPs utilisation (MFU) of the train step, its compiled memory, the
analytic estimate beside it and, on a device that reports it, the peak memory the process used.

MFU is given twice: against the matrix-multiply rate this same machine reaches in this same run
(a large square matmul in the step's compute dtype: the ceiling the step could reach here, the one
figure worth quoting on a CPU), and, on a device with a datasheet (configs/hardware.py), against
its dense bf16 peak. Model FLOPs are the model's training FLOPs per token (models/config.py: 6 per
matmul weight, 4 with a frozen LoRA base) without what remat recomputes.

  python -m bench.train_step                                  # the default config and shape
  python -m bench.train_step --config=configs/default.py:tiny --steps=20
  python -m bench.train_step --config.precision=bf16_mixed    # any config override
  python -m bench.train_step --out=bench.json                 # everything below, and memory.json's
                                                              # fields, as JSON
"""
import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags, logging
from ml_collections import config_flags

from bench.measure import bench_setup, matmul_flops_per_sec, random_batches

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].')
_STEPS = flags.DEFINE_integer('steps', 30, 'Timed steps (after the warm-up steps).')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untimed steps first (the first one compiles nothing: '
                               'the step is compiled before; they settle the allocator and clocks).')
_MATMUL = flags.DEFINE_integer('matmul_size', None, 'Side of the square matmul that measures the '
                               'reachable rate; default 8192 on an accelerator, 2048 on a CPU.')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')




def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from configs.hardware import datasheet
  from memory.compiled import GiB, device_memory_limit, peak_device_memory
  from models.attention import resolve
  from train import collector, init_from
  from train.run import compile_train_step, memory_report
  collector.settle()   # as main.py does once the libraries are imported

  config = _CONFIG.value
  if _STEPS.value < 1 or _WARMUP.value < 0:
    raise app.UsageError(f'--steps={_STEPS.value} --warmup={_WARMUP.value}; steps must be at '
                         f'least 1 and warmup at least 0')
  s = bench_setup(config)
  compiled = compile_train_step(s)
  memory = memory_report(s, compiled)
  train = config.train

  state = init_from.fresh_state(s)   # a frozen base (LoRA, QLoRA) drawn a layer at a time
  metrics = None
  for _ in range(_WARMUP.value):
    state, metrics = compiled(state, random_batches(s, 1)[0])
  jax.block_until_ready((state, metrics))
  batches = random_batches(s, _STEPS.value)
  start = time.perf_counter()
  for b in batches:
    state, metrics = compiled(state, b)
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - start) / _STEPS.value
  peak_bytes = peak_device_memory()
  loss = float(metrics['loss'])

  platform = jax.devices()[0].platform
  device_kind = jax.devices()[0].device_kind
  tokens_per_sec = train.batch_size * train.seq_len / seconds
  base_trains = not config.lora.rank
  flops_per_token = s.model.flops_per_token(train.seq_len, base_trains)
  causal_flops_per_token = s.model.flops_per_token(train.seq_len, base_trains, causal=True)
  # Per device, against one device's rates.
  model_flops = flops_per_token * tokens_per_sec / s.mesh.size
  matmul_size = _MATMUL.value or (2048 if platform == 'cpu' else 8192)
  reachable = matmul_flops_per_sec(matmul_size, s.policy.compute_dtype)
  sheet = datasheet(device_kind)
  peak_flops = sheet['peak_bf16'] if sheet else None
  # An fp8 run is stated against the fp8 peak too, where the GPU has one.
  fp8_peak = sheet['peak_fp8'] if sheet and config.quant.mode == 'fp8' else None
  results = {
      **memory,
      'config': config.name, 'precision': s.policy.name, 'quant_mode': config.quant.mode,
      'attention': resolve(config.model.attention, s.policy.compute_dtype, platform),
      'remat': config.model.remat, 'lora_rank': config.lora.rank,
      'devices': s.mesh.size, 'platform': platform, 'device_kind': device_kind,
      'batch_size': train.batch_size, 'seq_len': train.seq_len, 'microbatches': train.microbatches,
      'steps': _STEPS.value, 'warmup': _WARMUP.value, 'loss': loss,
      'base_trains': base_trains, 'flops_per_token': flops_per_token,
      'step_seconds': seconds, 'tokens_per_sec': tokens_per_sec,
      'model_flops_per_sec': model_flops, 'matmul_size': matmul_size,
      'matmul_flops_per_sec': reachable, 'mfu': model_flops / reachable,
      'peak_flops_per_sec': peak_flops,
      'mfu_peak': None if peak_flops is None else model_flops / peak_flops,
      'flops_per_token_causal': causal_flops_per_token,
      'mfu_peak_causal': (None if peak_flops is None else
                          causal_flops_per_token * tokens_per_sec / s.mesh.size / peak_flops),
      'peak_fp8_flops_per_sec': fp8_peak,
      'mfu_peak_fp8': None if fp8_peak is None else model_flops / fp8_peak,
      'peak_device_bytes': peak_bytes, 'device_bytes_limit': device_memory_limit(),
  }
  print(f'{config.name} ({s.policy.name}, {s.mesh.size} x {device_kind}), '
        f'batch {train.batch_size} x {train.seq_len} tokens, {s.model.num_params / 1e6:.2f} M params')
  print(f'  step time          {seconds * 1e3:.1f} ms (mean of {_STEPS.value}; loss {loss:.4f} nats/token)')
  print(f'  throughput         {tokens_per_sec:,.0f} tokens/s')
  print(f'  model FLOPs        {model_flops / 1e9:.2f} GFLOP/s per device '
        f'({flops_per_token / 1e6:.2f} MFLOP/token{"" if base_trains else ", frozen base"})')
  print(f'  matmul rate        {reachable / 1e9:.2f} GFLOP/s ({matmul_size}^2 '
        f'{jnp.dtype(s.policy.compute_dtype).name} matmul, best of 10)')
  if platform == 'cpu' and jnp.dtype(s.policy.compute_dtype) != jnp.float32:
    # XLA:CPU's 16-bit dots are not always faster than fp32 ones (jax 0.10's are slower; 0.12's run
    # bf16 at twice the fp32 rate on a CPU with AVX512_BF16): said where it is so.
    fp32_rate = matmul_flops_per_sec(matmul_size, jnp.float32)
    results['matmul_flops_per_sec_fp32'] = fp32_rate
    if fp32_rate >= reachable:
      print(f'  note               {jnp.dtype(s.policy.compute_dtype).name} matmuls run slower '
            f'than fp32 ones here ({fp32_rate / 1e9:.2f} GFLOP/s) on this jaxlib '
            f'({jax.__version__}): {s.policy.name} saves memory on this CPU, not time')
  print(f'  MFU                {100 * results["mfu"]:.1f} % of the measured matmul rate'
        + ('' if peak_flops is None else
           f', {100 * results["mfu_peak"]:.1f} % of the datasheet {peak_flops / 1e12:.0f} TFLOP/s '
           f'(PaLM\'s count: every attention pair); {100 * results["mfu_peak_causal"]:.1f} % by '
           f'the causal count (half the pairs: MaxText\'s)')
        + ('' if fp8_peak is None else
           f'; {100 * results["mfu_peak_fp8"]:.1f} % of the datasheet fp8 '
           f'{fp8_peak / 1e12:.0f} TFLOP/s (PaLM\'s count)'))
  compiled_bytes = memory['per_device_bytes']
  print(f'  compiled memory    {compiled_bytes["total"] / GiB:.3f} GiB per device (arguments '
        f'{compiled_bytes["arguments"] / GiB:.3f}, outputs {compiled_bytes["outputs"] / GiB:.3f}, '
        f'aliased {compiled_bytes["aliased"] / GiB:.3f}, temp {compiled_bytes["temp"] / GiB:.3f})')
  print(f'  estimate           {memory["estimate_bytes"]["total"] / GiB:.3f} GiB per device '
        f'({memory["estimate_gpu_bytes"]["total"] / GiB:.3f} GiB on a GPU)')
  if peak_bytes is not None:
    limit = results['device_bytes_limit']
    print(f'  peak in use        {peak_bytes / GiB:.3f} GiB on device 0 (the allocator\'s peak, '
          f'initialisation included' + ('' if limit is None else f'; it may use '
                                        f'{limit / GiB:.3f} GiB') + ')')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(results, f, indent=2)


if __name__ == '__main__':
  app.run(main)
