"""Where a train step's time goes, for any config: `jax.profiler` traces read back and summed.

Two parts, both in one command:

1. **The compiled step alone** (on batches already on the device, like bench/train_step.py), traced
   for `--steps` steps: the time of every XLA operation, as wall time (an operation split over
   several threads counts once), grouped by the part of the model it belongs to (the name scopes
   `embed`, `norm`, `attention`, `mlp`, `loss`, `optimizer`; forward and backward apart) and by what
   it is (matmul, elementwise/reduce, copy/transpose, data movement, collective). Beside them: the
   step's FLOPs from the compiled HLO's cost analysis and from the analytic count (6 per weight
   per token plus attention, models/config.py), the matmul rate this machine reaches in the same run
   (a large square matmul), and the fraction of it the step achieves; on a GPU with a datasheet
   (configs/hardware.py) its MFU too. The slowest operations other than matmuls come with the
   bytes they read and write (from the HLO: a layer's slice of a stacked operand counts as the
   slice) and the rate they move them at, beside a plain streaming op of the same size
   (bench/measure.py): far below it, the compiler's code is the limit, not the memory.
2. **The real training loop** (`train.run.train_and_evaluate`, in a scratch workdir), traced:
   tokens/s against the step alone, and the data path: how long reading a batch and copying it to
   the devices takes per step, and how much of that ran while the devices were computing (the feed
   reads ahead, train/feed.py).

  python -m bench.profile                                        # the default config (small)
  python -m bench.profile --config=configs/default.py:100m --config.precision=bf16_mixed
  python -m bench.profile --steps=10 --top=20 --out=profile.json --trace_dir=/tmp/trace

On a GPU the device's kernels (CUPTI's events in the trace) are read as well (bench/gpu_kernels.py):
kernels per step, busy time and the idle gaps between kernels, time by kernel kind (cuBLAS GEMMs,
fp32 ones apart, XLA's Triton GEMMs, cuDNN, loop and reduction fusions, copies, memsets,
collectives, host transfers) and the slowest kernels by name; the slowest operations other than
matmuls also say what fraction of the datasheet's memory bandwidth they reach. XLA's command
buffers (CUDA graphs) are turned off for it, so that every kernel names the HLO operation it runs
for (`--gpu_command_buffers` keeps them, as a run has them).

Times are per step, in ms. On the CPU every thread's events are merged, so a matmul spread over
both cores counts its wall time once; operations running at the same time on different threads
(XLA:CPU runs independent ones concurrently) each count theirs, so the parts may sum to more than
the step.
"""
import collections
import contextlib
import io
import json
import os
import tempfile
import time

import jax
from absl import app, flags, logging
from ml_collections import config_flags

from bench.gpu_kernels import (device_events, kernel_instruction, kernel_time, print_gpu_kernels,
                               slowest_kernels, without_command_buffers)
from bench.hlo_ops import KINDS, REGIONS, describe_instructions
from bench.trace import read_trace, union_us
from train.metrics import read_rows
from train.setup import Setup

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].')
_STEPS = flags.DEFINE_integer('steps', 5, 'Traced steps (after the warm-up).')
_WARMUP = flags.DEFINE_integer('warmup', 3, 'Untraced steps first.')
_TOP = flags.DEFINE_integer('top', 12, 'The slowest operations listed.')
_LOOP = flags.DEFINE_bool('loop', True, 'Also trace the real training loop.')
_TRACE_DIR = flags.DEFINE_string('trace_dir', None, 'Keep the traces here (TensorBoard / Perfetto '
                                 'read them); default: a scratch directory, removed.')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')
_COMMAND_BUFFERS = flags.DEFINE_bool(
    'gpu_command_buffers', False, 'On a GPU, keep XLA\'s command buffers (CUDA graphs), as a run '
    'has them; by default they are off, so that every kernel names the HLO operation it runs for '
    '(inside one, a cuBLAS or cuDNN kernel names only the command buffer).')


# ---- the trace ---------------------------------------------------------------------------------
def op_events(events: list[dict], described: dict) -> list[dict]:
  """Events of the program's instructions: a CPU thunk's name, or the instruction a GPU kernel
  belongs to (bench/gpu_kernels.py: its `hlo_op`, or the fusion its name was made from)."""
  found = []
  for e in events:
    if e.get('process', '').startswith('/device:GPU'):
      name = kernel_instruction(e, described)
    else:
      name = e.get('args', {}).get('hlo_op') or e['name']
    if name in described:
      found.append({**e, 'op': name})
  return found


def _merged(intervals) -> list[tuple[float, float]]:
  """Overlapping [start, end) intervals joined: one per execution of an operation whose work was
  split over threads."""
  merged = []
  for start, end in sorted(intervals):
    if merged and start <= merged[-1][1]:
      merged[-1] = (merged[-1][0], max(merged[-1][1], end))
    else:
      merged.append((start, end))
  return merged


def split_time(ops: list[dict], described: dict, steps: int) -> dict:
  """ms per step by (region, forward/backward, kind), by kind, and per instruction: wall time,
  each instruction's events merged across threads; and each instruction's executions per step."""
  by_group, by_kind, by_op = (collections.defaultdict(list) for _ in range(3))
  for e in ops:
    d = described[e['op']]
    interval = (e['ts'], e['ts'] + e['dur'])
    pass_ = 'backward' if d['backward'] else 'forward'
    by_group[(d['region'], pass_, d['kind'])].append(interval)
    by_kind[d['kind']].append(interval)
    by_op[e['op']].append(interval)
  ms = lambda intervals: union_us(intervals) / 1e3 / steps
  return {'groups': {'/'.join(k): ms(v) for k, v in by_group.items()},
          'kinds': {k: ms(v) for k, v in by_kind.items()},
          'ops': {k: ms(v) for k, v in by_op.items()},
          'runs': {k: len(_merged(v)) / steps for k, v in by_op.items()},
          'busy': ms([iv for v in by_kind.values() for iv in v])}


def memory_rates(top: list[dict], hbm: float | None = None) -> None:
  """Adds to each of the slowest operations other than matmuls the bytes it moves per step, the
  rate it moves them at, the rate a plain streaming op of the same size reaches here (bench/
  measure.py) and, on a GPU with a datasheet, the fraction of its memory bandwidth (`hbm`, bytes/s):
  where an operation runs far below them, the compiler's code for it is the limit, not the memory."""
  from bench.measure import streaming_bytes_per_sec
  for r in top:
    if r['kind'] == 'matmul' or not r['bytes'] or not r['ms']:
      continue
    r['bytes_per_sec'] = r['bytes'] * r['runs'] / (r['ms'] / 1e3)
    r['streaming_bytes_per_sec'] = streaming_bytes_per_sec(r['bytes'])
    if hbm:
      r['fraction_of_hbm'] = r['bytes_per_sec'] / hbm


# ---- the two measurements ----------------------------------------------------------------------
def _options():
  """No Python function events: they would swamp the trace's buffers (and the loop's own marks)."""
  options = jax.profiler.ProfileOptions()
  options.python_tracer_level = 0
  return options


def profile_step(s: Setup, compiled, steps: int, warmup: int, trace_dir: str) -> dict:
  from bench.measure import random_batches
  from train import init_from
  state = init_from.fresh_state(s)
  batches = random_batches(s, max(steps, 2))
  for i in range(warmup):
    state, metrics = compiled(state, batches[i % len(batches)])
  jax.block_until_ready(state)
  jax.profiler.start_trace(trace_dir, profiler_options=_options())
  start = time.perf_counter()
  for i in range(steps):
    state, metrics = compiled(state, batches[i % len(batches)])
  jax.block_until_ready((state, metrics))
  seconds = (time.perf_counter() - start) / steps
  jax.profiler.stop_trace()
  return {'step_seconds': seconds}


def profile_loop(config, steps: int, warmup: int, trace_dir: str) -> dict:
  """The real loop for warmup + steps steps in a scratch workdir, the last `steps` traced by
  tokens/s (the loop's own figure) and by the feed's annotations."""
  from train import run
  total = warmup + steps
  config = config.copy_and_resolve_references()
  config.train.steps = total
  config.train.log_every = warmup if warmup else total   # a row at the warm-up's end, then at the end
  config.train.eval_every = total
  config.train.checkpoint_every = total
  config.train.eval_tokens = config.train.batch_size * config.train.seq_len
  config.sample.length = 1
  with tempfile.TemporaryDirectory() as workdir:
    jax.profiler.start_trace(trace_dir, profiler_options=_options())
    # The run's own report and progress bars: not this one's.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
      run.train_and_evaluate(config, workdir)
    jax.profiler.stop_trace()
    rows = {r['step']: r for r in read_rows(os.path.join(workdir, 'metrics.jsonl'))}
  return {'tokens_per_sec': rows[total]['tokens_per_sec'], 'steps': steps}


def loop_data_path(events: list[dict], ops: list[dict], steps: int) -> dict:
  """The feed's reads (train/feed.py's annotations) during the traced loop: ms per step, and the
  share of that time during which some XLA operation was running (the read overlapped compute)."""
  reads = [(e['ts'], e['ts'] + e['dur']) for e in events
           if e['name'] == 'data: read and copy to device']
  if not reads:
    return {'read_ms_per_step': None, 'overlap': None}
  busy = sorted((e['ts'], e['ts'] + e['dur']) for e in ops)
  overlapped = 0.0
  for start, end in reads:
    overlapped += union_us([(max(a, start), min(b, end)) for a, b in busy if a < end and b > start])
  read = sum(end - start for start, end in reads)
  return {'read_ms_per_step': read / 1e3 / len(reads), 'overlap': overlapped / read if read else None,
          'reads': len(reads)}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from bench.measure import bench_setup, matmul_flops_per_sec
  from configs.hardware import datasheet
  from train import compile_cache
  from train.run import compile_train_step

  config = _CONFIG.value
  if _STEPS.value < 2 or _WARMUP.value < 1:
    raise app.UsageError(f'--steps={_STEPS.value} --warmup={_WARMUP.value}; steps must be at '
                         f'least 2 and warmup at least 1')
  graphs_off = not _COMMAND_BUFFERS.value and without_command_buffers()
  s = bench_setup(config)   # sets the simulated devices, which the cache's verdict reads
  # The loop below compiles the same step again: with the cache on (the default) it loads this one.
  compile_cache.enable(config.get('compile_cache', ''), off_because=compile_cache.unserved())
  compiled = compile_train_step(s)
  described = describe_instructions(compiled.as_text())
  train = config.train
  tokens = train.batch_size * train.seq_len
  steps = _STEPS.value

  keep = _TRACE_DIR.value
  scratch = tempfile.TemporaryDirectory()
  root = keep or scratch.name
  step_dir, loop_dir = os.path.join(root, 'step'), os.path.join(root, 'loop')
  timing = profile_step(s, compiled, steps, _WARMUP.value, step_dir)
  events = read_trace(step_dir)
  ops = op_events(events, described)
  split = split_time(ops, described, steps)
  kernels = device_events(events)
  step_ms = timing['step_seconds'] * 1e3

  platform, device_kind = jax.devices()[0].platform, jax.devices()[0].device_kind
  base_trains = not config.lora.rank
  analytic = s.model.flops_per_token(train.seq_len, base_trains) * tokens
  causal = s.model.flops_per_token(train.seq_len, base_trains, causal=True) * tokens
  cost = compiled.cost_analysis()
  cost = cost[0] if isinstance(cost, (list, tuple)) else cost
  hlo_flops = float(cost.get('flops', 0.0)) if cost else None
  rate = matmul_flops_per_sec(2048 if platform == 'cpu' else 8192, s.policy.compute_dtype)
  achieved = analytic / s.mesh.size / timing['step_seconds']
  matmul_ms = split['kinds'].get('matmul', 0.0)
  sheet = datasheet(device_kind)
  results = {
      'config': config.name, 'precision': s.policy.name, 'devices': s.mesh.size,
      'platform': platform, 'device_kind': device_kind, 'batch_size': train.batch_size,
      'seq_len': train.seq_len, 'step_ms': step_ms, 'tokens_per_sec': tokens / timing['step_seconds'],
      'xla_busy_ms': split['busy'], 'kinds_ms': split['kinds'], 'groups_ms': split['groups'],
      'analytic_flops': analytic, 'hlo_flops': hlo_flops, 'matmul_flops_per_sec': rate,
      'model_flops_per_sec': achieved, 'fraction_of_matmul_rate': achieved / rate,
      'matmul_ms_rate': analytic / s.mesh.size / (matmul_ms / 1e3) if matmul_ms else None,
      'mfu_datasheet': achieved / sheet['peak_bf16'] if sheet else None,
      'mfu_datasheet_causal': (causal / s.mesh.size / timing['step_seconds'] / sheet['peak_bf16']
                               if sheet else None),
      'top_ops': sorted(({'op': k, 'ms': v, 'runs': split['runs'][k], **described[k]}
                         for k, v in split['ops'].items()), key=lambda r: -r['ms'])[:_TOP.value],
  }
  # The slowest of the rest apart: with the layers unrolled every matmul is an operation of its own
  # and they fill the list above.
  results['top_other_ops'] = [r for r in sorted(
      ({'op': k, 'ms': v, 'runs': split['runs'][k], **described[k]}
       for k, v in split['ops'].items()), key=lambda r: -r['ms'])
      if r['kind'] != 'matmul'][:_TOP.value]
  memory_rates(results['top_other_ops'], sheet['hbm'] if sheet else None)
  if kernels:
    results['gpu'] = {**kernel_time(kernels, steps), 'command_buffers': not graphs_off,
                      'attributed_ms': split['busy'],
                      'slowest_kernels': slowest_kernels(kernels, steps, _TOP.value)}

  print(f'{config.name} ({s.policy.name}, {s.mesh.size} x {device_kind}), batch {train.batch_size} '
        f'x {train.seq_len} tokens: the compiled step alone, {steps} traced steps')
  print(f'  step               {step_ms:8.1f} ms  ({results["tokens_per_sec"]:,.0f} tokens/s); XLA '
        f'operations busy {split["busy"]:.1f} ms of it')
  print(f'  {"ms per step":18s} ' + ' '.join(f'{k:>14s}' for k in KINDS) + f' {"total":>8s}')
  for region in REGIONS + ('other',):
    for pass_ in ('forward', 'backward'):
      row = [split['groups'].get(f'{region}/{pass_}/{k}', 0.0) for k in KINDS]
      if sum(row) >= 0.05:
        print(f'  {region + " " + pass_[:3]:18s} ' + ' '.join(f'{v:14.1f}' for v in row)
              + f' {sum(row):8.1f}')
  print(f'  {"all":18s} ' + ' '.join(f'{split["kinds"].get(k, 0.0):14.1f}' for k in KINDS))
  print(f'  FLOPs per step     {analytic / 1e9:.2f} GFLOP analytic (6 per weight per token + '
        f'attention), ' + (f'{hlo_flops / 1e9:.2f} GFLOP in the compiled HLO\'s cost analysis '
                           f'(which counts a loop body, such as the layers\' scan, once)'
                           if hlo_flops else 'the HLO reports none'))
  print(f'  matmul rate        {rate / 1e9:.1f} GFLOP/s measured ({"2048" if platform == "cpu" else "8192"}'
        f'^2 matmul); the step achieves {achieved / 1e9:.1f} GFLOP/s, '
        f'{100 * results["fraction_of_matmul_rate"]:.1f} % of it'
        + (f'; its matmuls alone run at {results["matmul_ms_rate"] / 1e9:.1f} GFLOP/s'
           if results['matmul_ms_rate'] else ''))
  if sheet:
    print(f'  MFU                {100 * results["mfu_datasheet"]:.1f} % of the datasheet '
          f'{sheet["peak_bf16"] / 1e12:.0f} TFLOP/s (bf16 dense) by PaLM\'s count (every attention '
          f'pair), {100 * results["mfu_datasheet_causal"]:.1f} % by the causal count (half the '
          f'pairs: MaxText\'s)')
  print('  slowest operations (ms per step, all runs together):')
  for r in results['top_ops']:
    print(f'    {r["ms"]:7.2f}  {r["op"]:28s} {r["kind"]:14s} {r["region"]:9s} '
          f'{"bwd" if r["backward"] else "fwd"}  {r["shape"][:40]}')
  print('  slowest operations other than matmuls (MB moved per run x runs per step, GB/s, beside '
        'the GB/s of a plain streaming op of that size here):')
  for r in results['top_other_ops']:
    rates = (f'{r["bytes"] / 1e6:6.1f} MB x {r["runs"]:3.0f} {r["bytes_per_sec"] / 1e9:6.1f} GB/s '
             f'(stream {r["streaming_bytes_per_sec"] / 1e9:5.1f}'
             + (f', {100 * r["fraction_of_hbm"]:.0f} % of HBM' if 'fraction_of_hbm' in r else '')
             + ')' if 'bytes_per_sec' in r else '')
    print(f'    {r["ms"]:7.2f}  {r["op"]:28s} {r["kind"]:14s} {r["region"]:9s} '
          f'{"bwd" if r["backward"] else "fwd"}  {rates}  {r["shape"][:32]}')

  if kernels:
    print_gpu_kernels(results['gpu'])

  if _LOOP.value:
    loop = profile_loop(config, steps, _WARMUP.value, loop_dir)
    events = read_trace(loop_dir)
    data = loop_data_path(events, op_events(events, described), steps)
    results['loop'] = {**loop, **data}
    print(f'the real training loop (train_and_evaluate), {steps} steps after {_WARMUP.value}:')
    print(f'  throughput         {loop["tokens_per_sec"]:,.0f} tokens/s, '
          f'{loop["tokens_per_sec"] / results["tokens_per_sec"]:.2f}x the step alone')
    if data['read_ms_per_step'] is not None:
      print(f'  data               {data["read_ms_per_step"]:.2f} ms per batch to read and copy to '
            f'the devices, in a thread; {100 * data["overlap"]:.0f} % of it while XLA computed')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump(results, f, indent=2)
  scratch.cleanup()


if __name__ == '__main__':
  app.run(main)
