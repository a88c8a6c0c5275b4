"""The run's opening summary: config, devices, model, layout, the step's compile time, memory
(compiled and estimated) and collectives per step, printed once (main process) before the first
step."""
import jax

from memory.compiled import compiler_of, format_bytes
from memory.estimate import format_parts
from quant.recipe import describe as describe_recipe
from train import compile_cache
from train.setup import Setup


def print_summary(s: Setup, memory: dict) -> None:
  if jax.process_index() != 0:
    return
  compiled, estimated = memory['per_device_bytes'], memory['estimate_bytes']
  print(f'config      {s.config.name}  (precision {s.policy.name}: {s.policy.description})')
  quant = s.config.quant
  print(f'quant       matmuls {describe_recipe(s.policy.matmul)}; Adam moments {quant.adam_bits}-bit')
  print(f'devices     {_devices(s, memory)}; mesh {dict(s.mesh.shape)}')
  print(f'model       {s.model.num_params / 1e6:.2f} M parameters, {s.model.num_layers} layers, '
        f'd_model {s.model.d_model}, vocabulary {s.model.vocab_size:,}, remat {s.model.remat}')
  adapters = s.spec.adapters
  if adapters is not None:
    storage = s.spec.base_format or f'{jax.numpy.dtype(s.policy.compute_dtype).name} matrices'
    print(f'lora        rank {adapters.rank}, alpha {adapters.alpha:g}, dropout {adapters.dropout:g} '
          f'on {adapters.targets!r}; trainable {memory["trainable_params"] / 1e6:.3f} M of '
          f'{s.model.num_params / 1e6:.2f} M parameters; frozen base {format_bytes(memory["frozen_bytes"])}'
          f' ({storage})')
    if not s.config.init_from:
      print('note        no init_from: the adapters adapt a randomly initialised base; fine-tune '
            'a checkpoint with --config.init_from=hf:DIR or run:DIR')
  print(f'layout      zero_stage {s.config.parallel.zero_stage}; batch {s.config.train.batch_size} '
        f'sequences x {s.config.train.seq_len} tokens in {s.config.train.microbatches} microbatch(es)')
  pipe = memory.get('pipeline')
  if pipe:
    counts = sorted(set(pipe['chunk_layers']))
    depth = (f'{counts[0]} layer(s)' if len(counts) == 1 else
             f'{",".join(map(str, pipe["chunk_layers"]))} layers')
    print(f'pipeline    {pipe["schedule"]}: {pipe["stages"]} stages x {pipe["repeats"]} chunk(s) of '
          f'{depth}, {pipe["microbatches"]} '
          f'microbatches, {pipe["iterations"]} iterations; bubble {pipe["bubble_fraction"]:.1%} of '
          f'stage-iterations')
  print(f'compiled    train step in {memory["compile_seconds"]:.1f} s '
        f'({compile_cache.describe(memory["compile_cache_hit"])})')
  b = format_bytes
  print(f'memory      per device, compiled by {memory["compiler"]}: {b(compiled["total"])} = arguments '
        f'{b(compiled["arguments"])} + outputs {b(compiled["outputs"])} - donated '
        f'{b(compiled["aliased"])} + temp {b(compiled["temp"])}')
  print(f'            per device, estimate (analytic, of {compiler_of(s.platform)}): '
        f'{b(estimated["total"])} = {format_parts(estimated)}')
  if 'host_bytes' in memory:
    host = memory['host_bytes']
    line = (f'            host memory, compiled: {b(host["total"])} per device, '
            f'{b(host["per_host"])} per host')
    if 'estimate_host_bytes' in memory:
      line += f'; estimate: {b(memory["estimate_host_bytes"]["total"])} per device'
    print(line)
    if s.platform == 'cpu':
      print('            (XLA:CPU keeps in device temp what a step writes to host memory: '
            'host_writes above; a GPU does not)')
  if 'init_bytes' in memory:
    init = memory['init_bytes']
    print(f'            creating the state, compiled: peak {b(init["peak"])} per device (the state '
          f'itself {b(init["state"])})'
          + ('; above the step\'s' if init['peak'] > compiled['total'] else ''))
  if s.platform == 'cpu':
    print(f'            on a GPU, estimate: {b(memory["estimate_gpu_bytes"]["total"])} (the analytic '
          f'model of XLA:GPU); XLA:GPU\'s own figure: --dry_run --target=<N>x<GPU>')
  if 'target' in memory:
    print(f'note        the figures are XLA:GPU\'s of jax {jax.__version__}: XLA\'s fusion and '
          f'scheduling change between releases, so compile with the jax the GPUs will run')
  if s.config.model.scan_unroll > 1:
    # Unrolled, XLA:GPU recomputed 8 of 7b's layers at once under ZeRO-3 on 8 H100s: 24.30 GiB
    # against 16.36 rolled (WORKSPACE, 2026-12-07).
    print(f'note        model.scan_unroll={s.config.model.scan_unroll}: the estimate models the '
          f'rolled layer scan; XLA schedules unrolled layers freely, so go by the compiled figure')
  active = {k: v for k, v in memory['collectives_per_step'].items() if v['count']}
  print('collectives per step per device: ' + ('; '.join(
      f'{k} {v["count"]} ops, {b(v["bytes"])} in all' for k, v in active.items()) or 'none'))
  if s.config.parallel.zero_stage and s.mesh.shape['fsdp'] * s.mesh.shape['context'] == 1:
    print(f'note        zero_stage {s.config.parallel.zero_stage} shards over the fsdp and context '
          f'axes, which have size 1 here: nothing is sharded (set --config.mesh.fsdp)')
  if s.mesh.shape['context'] > 1:
    print(f'note        mesh.context={s.mesh.shape["context"]}: attention is the context-parallel '
          f'blockwise kernel (models/context.py) whatever model.attention says')


def _devices(s: Setup, memory: dict) -> str:
  """What the step was compiled for: this process's devices, or a target's compile-only GPUs."""
  devices = list(s.mesh.devices.flat)
  if 'target' in memory:
    hosts = len({d.process_index for d in devices})
    return (f'{len(devices)} x {devices[0].device_kind} on {hosts} host(s), compile-only '
            f'(--target={memory["target"]}: XLA:GPU on this machine\'s CPU, nothing allocated)')
  return f'{len(devices)} x {devices[0].platform} in {jax.process_count()} process(es)'
