"""What the compiled train step holds at its memory peak, beside the estimate's terms.

Compiles the step of any config (as the dry run does: nothing is allocated, any model size on
simulated CPU devices) with XLA's dumps on, and prints the live buffers at the peak of its temp
memory (bench/peak_buffers.py): their shapes, sizes, and the JAX operation that made each (name
scopes such as `mlp`, `attention`, `optimizer`; `transpose(...)` for the backward pass). This is
how a gap between the estimate and the compiler is explained before either is changed.

  python -m bench.buffers --config=configs/default.py:70b --config.host_devices=8 \\
      --config.mesh.data=1 --config.mesh.fsdp=-1 --config.parallel.zero_stage=2 \\
      --config.train.batch_size=8 --config.train.microbatches=1
  python -m bench.buffers --top=30 --dump_dir=/tmp/dump     # keep XLA's dump files
  python -m bench.buffers --config=configs/default.py:1b --target=1xH100-80GB   # XLA:GPU's program,
      # compiled for that GPU on any machine (as main.py --dry_run --target)
  python -m bench.buffers --phases --top=8     # also each phase's own peak (layers forward and
      # backward, head, update: bench/peak_buffers.py:PHASES), what the estimate's phases model
"""
import tempfile

from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].')
_TOP = flags.DEFINE_integer('top', 15, 'The largest live buffers listed.')
_DUMP_DIR = flags.DEFINE_string('dump_dir', None, 'Keep XLA\'s dumps here (default: a scratch '
                                'directory, removed).')
_TARGET = flags.DEFINE_string('target', None, '<N>x<GPU>: compile for that GPU with XLA:GPU, here '
                              '(requirements-gpu-compile.txt); default this machine\'s devices.')

_PHASES = flags.DEFINE_bool('phases', False, 'Also print each phase of the step at its own peak '
                            '(bench/peak_buffers.py:PHASES), a collective\'s values as one line.')

GiB = 2.0**30


def _grouped(live) -> list[tuple[int, int, str, str, str]]:
  """(bytes, values, name, first shape, op_name), largest first: the values of one asynchronous
  collective (`all-gather-start.2{1,6}`, `{1,7}`, ...) as one line, since it frees them together."""
  groups = {}
  for b in live:
    key = b.name.split('{')[0] if '-start' in b.name else b.name
    size, count, shape, op_name = groups.get(key, (0, 0, b.shape, b.op_name))
    groups[key] = (size + b.size, count + 1, shape, op_name)
  return sorted(((size, count, key, shape, op_name)
                 for key, (size, count, shape, op_name) in groups.items()), key=lambda g: -g[0])


def _setup(config):
  """The run's setup on this machine's devices, or on `--target`'s compile-only GPUs."""
  from bench.measure import bench_setup
  if _TARGET.value is None:
    return bench_setup(config)
  import jax
  from parallel.target import TargetCompileError, prepare
  from plan.target import TargetError, compile_devices, parse_target
  from train.run import setup
  try:
    target = parse_target(_TARGET.value)
    prepare()
    jax.config.update('jax_platforms', 'cpu')
    return setup(config, compile_devices(target))
  except (TargetError, TargetCompileError) as e:
    raise app.UsageError(str(e)) from None


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from bench.peak_buffers import compile_with_dumps, read_peak, read_phases
  from memory.compiled import format_bytes
  from memory.estimate import format_parts
  from train.run import lower_train_step, memory_report

  config = _CONFIG.value
  s = _setup(config)
  scratch = tempfile.TemporaryDirectory()
  directory = _DUMP_DIR.value or scratch.name
  lowered = lower_train_step(s)
  with s.context():
    compiled = compile_with_dumps(lowered, directory)
  report = memory_report(s, compiled)
  peak = read_peak(directory)
  compiled_bytes, estimate = report['per_device_bytes'], report['estimate_bytes']
  print(f'{config.name} on {s.mesh.size} x {report["device_kind"]} {dict(s.mesh.shape)}, '
        f'ZeRO-{report["zero_stage"]}, {s.policy.name}, remat {s.model.remat}, compiled by '
        f'{report["compiler"]}, per device:')
  print(f'  compiled   {format_bytes(compiled_bytes["total"])} = arguments '
        f'{format_bytes(compiled_bytes["arguments"])} + outputs {format_bytes(compiled_bytes["outputs"])}'
        f' - donated {format_bytes(compiled_bytes["aliased"])} + temp {format_bytes(compiled_bytes["temp"])}')
  error = estimate['total'] / compiled_bytes['total'] - 1
  print(f'  estimate   {format_bytes(estimate["total"])} = {format_parts(estimate)} '
        f'({100 * error:+.1f} %)')
  print(f'  temp peak  {format_bytes(peak.peak_bytes)} live while `{peak.at}` runs'
        + (f' ({peak.at_op_name})' if peak.at_op_name else '') + f'; {len(peak.live)} buffers, '
        f'the largest:')
  for b in peak.live[:_TOP.value]:
    print(f'    {b.size / GiB:10.4f} GiB  {b.shape[:40]:40s} {b.name[:32]:32s} {b.op_name}')
  if _PHASES.value:
    print(f'  by phase (the largest live set while one of its instructions runs; the temp '
          f'allocation is {format_bytes(peak.temp_bytes)}):')
    for phase, at in read_phases(directory).items():
      print(f'  {phase:16s} {format_bytes(at.peak_bytes)} live while `{at.at}` runs; the largest:')
      for size, count, name, shape, op_name in _grouped(at.live)[:_TOP.value]:
        values = f'{count} values' if count > 1 else shape[:40]
        print(f'    {size / GiB:10.4f} GiB  {values:40s} {name[:32]:32s} {op_name[:120]}')
  scratch.cleanup()


if __name__ == '__main__':
  app.run(main)
