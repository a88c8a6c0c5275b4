"""Train, dry-run or size a language model from a config file.

  python main.py --config=configs/default.py[:preset] [--config.key=value ...] [--workdir=DIR]
                 [--host_devices=N] [--dry_run [--target=<N>x<GPU>]] [--plan --target=<N>x<GPU>]
                 [--coordinator_address=H:P --num_processes=N --process_id=I]
"""
import datetime
import os
import sys

from absl import app, flags, logging
from ml_collections import config_flags

DEFAULT_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'configs', 'default.py')
# No default here: ml_collections would parse it, and every override, at import time.
_CONFIG = config_flags.DEFINE_config_file('config', None, 'Experiment config file[:preset]; '
                                          'default configs/default.py.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory; default: a fresh folder under runs/. '
                               'Re-using one resumes from its latest checkpoint.')
_HOST_DEVICES = flags.DEFINE_integer('host_devices', None, 'With no accelerator, simulate N CPU devices.')
_DRY_RUN = flags.DEFINE_bool('dry_run', False, 'Compile the train step, report its memory, run nothing.')
_PLAN = flags.DEFINE_bool('plan', False, 'Find the fastest recipe that fits --target (verified by '
                          'compiling for it: XLA:GPU where the CUDA plugin is installed, else '
                          'simulated CPU devices), and write it as a config file.')
_TARGET = flags.DEFINE_string('target', None, 'With --plan or --dry_run: <N>x<GPU>, e.g. 8xA100-80GB, '
                              '64xH100-80GB, 1xRTX4090-24GB, or <N>x<M>GB; --dry_run compiles for it '
                              'with XLA:GPU on any machine (requirements-gpu-compile.txt).')
_TARGET_CONFIG = flags.DEFINE_string(
    'target_config', None, 'With --dry_run --target: a file holding the GPU\'s description as XLA '
    'takes it (a GpuTargetConfig text proto, e.g. the *gpu_target_config.pbtxt that '
    'XLA_FLAGS=--xla_dump_to=DIR writes on that GPU); default configs/gpu_targets.py\'s.')
_PLAN_STAGES = flags.DEFINE_bool('plan_stages', True, 'With --plan: pipeline stages may be chosen '
                                  '(targets of several nodes).')
_PLAN_ALLOW_PURE_BF16 = flags.DEFINE_bool(
    'plan_allow_pure_bf16', False, 'With --plan: recipes without an fp32 master copy (precision=bf16, '
    'whose optimizer rounds every update to bf16) may be chosen.')
_COORDINATOR = flags.DEFINE_string('coordinator_address', None, 'Multi-host: host:port of process 0.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', None, 'Multi-host: number of processes.')
_PROCESS_ID = flags.DEFINE_integer('process_id', None, 'Multi-host: this process\'s index.')
_COORDINATOR_TIMEOUT = flags.DEFINE_integer('coordinator_timeout', 300, 'Multi-host: seconds to wait '
                                            'for every process to reach the coordinator.')
_PEER_TIMEOUT = flags.DEFINE_float('peer_timeout', 60, 'Multi-host: seconds without a heartbeat from '
                                   'another process after which the others stop (exit code 75).')


def _init_jax(config, plan_devices: int | None = None, gpu_target: bool = False) -> list[str]:
  """The backend (`_init_backend`), then the persistent compilation cache, which depends on the
  devices it gave. Returns the XLA flags added (GPU defaults)."""
  added = _init_backend(config, plan_devices, gpu_target)
  from configs import default
  from train import compile_cache
  try:
    compile_cache.enable(config.get('compile_cache', default.COMPILE_CACHE),
                         off_because=compile_cache.unserved(gpu_target))
  except compile_cache.CacheDirError as e:
    sys.exit(f'error: {e}')
  return added


def _init_backend(config, plan_devices: int | None, gpu_target: bool) -> list[str]:
  """The GPU's XLA flags, device simulation and multi-host set-up: all before JAX touches a
  backend. `gpu_target`: the step compiles for GPUs that need not be here (parallel/target.py).
  Returns the XLA flags added (GPU defaults)."""
  import jax
  from parallel import xla_flags
  if gpu_target:
    from parallel.target import TargetCompileError, prepare
    try:
      added = prepare()
    except TargetCompileError as e:
      sys.exit(f'error: {e}')
    jax.config.update('jax_platforms', 'cpu')
    return added
  if plan_devices:   # a plan compiles for the target's device count, on the CPU whatever is here
    jax.config.update('jax_platforms', 'cpu')
    jax.config.update('jax_num_cpu_devices', plan_devices)
    return []
  if not jax.config.jax_platforms and xla_flags.cuda_plugin_without_gpu():
    # The CUDA plugin is installed (for --target, say) but no GPU is here: JAX would try it first
    # and print a traceback before falling back to the CPU.
    jax.config.update('jax_platforms', 'cpu')
  added = xla_flags.apply(jax.config.jax_platforms)
  host_devices = _HOST_DEVICES.value if _HOST_DEVICES.value is not None else config.get('host_devices', 0)
  if not isinstance(host_devices, int) or host_devices < 0 or _HOST_DEVICES.value == 0:
    sys.exit(f'error: host_devices={host_devices!r}; it must be a positive integer')
  if host_devices:
    # Only the CPU backend reads this: on a GPU machine jax.devices() is still the GPUs.
    jax.config.update('jax_num_cpu_devices', host_devices)
  from parallel import distributed
  explicit = any(v is not None for v in (_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value))
  if not (explicit or distributed.launched_as_several_tasks()):
    return added
  try:
    distributed.initialize(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value,
                           _COORDINATOR_TIMEOUT.value, _PEER_TIMEOUT.value)
  except distributed.CoordinatorError as e:
    sys.exit(f'error: {e}')
  return added


def _unknown_override(argv) -> str | None:
  """The first `--config.a.b=v` whose key the config does not have, as a one-line message."""
  import configs
  node = configs.load(_config_spec(argv))
  for arg in argv:
    if not arg.startswith('--config.'):
      continue
    key = arg[len('--config.'):].split('=', 1)[0]
    node_here = node
    for depth, part in enumerate(key.split('.')):
      if not hasattr(node_here, 'keys') or part not in node_here:
        parent = '.'.join(key.split('.')[:depth]) or 'the config'
        known = ', '.join(sorted(node_here.keys())) if hasattr(node_here, 'keys') else 'none'
        return f'unknown config key {key!r}; keys of {parent}: {known}'
      node_here = node_here[part]
  return None


def _joined_config_flag(argv: list[str]) -> list[str]:
  """`--config path` as `--config=path`, so the checks below see one form."""
  out, i = [], 0
  while i < len(argv):
    if argv[i] == '--config' and i + 1 < len(argv):
      out.append(f'--config={argv[i + 1]}')
      i += 2
    else:
      out.append(argv[i])
      i += 1
  return out


def _config_spec(argv: list[str]) -> str:
  return next(a.split('=', 1)[1] for a in argv if a.startswith('--config='))


def _parse_flags(argv):
  """absl's parser, with one line (not a traceback) for an override of a key that does not exist."""
  argv = _joined_config_flag(argv)
  if not any(a.startswith('--config=') for a in argv):
    argv = [argv[0], f'--config={DEFAULT_CONFIG}', *argv[1:]]
  spec = _config_spec(argv)
  if not os.path.isfile(spec.partition(':')[0]):
    folder = os.path.dirname(DEFAULT_CONFIG)
    configs = [f'configs/{f}' for f in sorted(os.listdir(folder))
               if f.endswith('.py') and 'def get_config' in open(os.path.join(folder, f)).read()]
    sys.exit(f'error: --config={spec}: no such config file; known: {", ".join(configs)}')
  try:
    return flags.FLAGS(argv)
  except (AttributeError, KeyError):
    message = _unknown_override(argv)
    if message is None:
      raise
    sys.exit(f'error: {message}')
  except (flags.Error, ValueError) as e:
    # A config file's own error arrives wrapped in absl's multi-line report: keep its last line.
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    sys.exit(f'error: {lines[-1] if lines else e}')


def _default_workdir(config_name: str) -> str:
  stamp = datetime.datetime.now().strftime('%Y%m%d-%H%M%S')
  return os.path.join('runs', f'{config_name.replace(":", "-")}-{stamp}')


def _target():
  """`--target` parsed, or None; each flag that does not go with the others refused in one line."""
  if _TARGET_CONFIG.value is not None and not (_DRY_RUN.value and _TARGET.value):
    sys.exit(f'error: --target_config={_TARGET_CONFIG.value!r} goes with --dry_run --target=<N>x<GPU>')
  if _TARGET_CONFIG.value is not None and not os.path.isfile(_TARGET_CONFIG.value):
    sys.exit(f'error: --target_config={_TARGET_CONFIG.value!r}: no such file')
  if not (_PLAN.value or _TARGET.value):
    return None
  if not _TARGET.value or not (_PLAN.value or _DRY_RUN.value) or (_PLAN.value and _DRY_RUN.value):
    sys.exit('error: --target=<N>x<GPU> goes with --plan (the fastest recipe for it) or with '
             '--dry_run (this config compiled for it), one of them: e.g. --plan '
             '--target=8xA100-80GB')
  if _DRY_RUN.value and _HOST_DEVICES.value is not None:
    sys.exit(f'error: --host_devices={_HOST_DEVICES.value} with --target={_TARGET.value}: the '
             f'target says the devices; drop one')
  from plan.target import TargetError, parse_target
  try:
    return parse_target(_TARGET.value)
  except TargetError as e:
    sys.exit(f'error: {e}')


def _target_devices(target) -> list:
  """The target's compile-only GPUs, described by `--target_config` or configs/gpu_targets.py."""
  from parallel.target import TargetCompileError
  from plan.target import compile_devices
  described = None
  if _TARGET_CONFIG.value:
    with open(_TARGET_CONFIG.value, encoding='utf-8') as f:
      described = f.read()
  try:
    return compile_devices(target, described)
  except TargetCompileError as e:
    sys.exit(f'error: {e}')


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]}; config values are set as --config.key=value')
  logging.set_verbosity(logging.WARNING)  # orbax narrates every save at INFO
  target = _target()
  compiled_target = target if _DRY_RUN.value else None
  added_flags = _init_jax(_CONFIG.value, plan_devices=target.count if _PLAN.value else None,
                          gpu_target=compiled_target is not None)
  from train import imports
  imports.flax_nnx()   # before anything imports it: without IPython's import
  from data import DataError
  from train import checks, run
  from parallel.peers import EXIT_LOST_PEER   # sysexits' EX_TEMPFAIL: start again
  from train.checkpoint import CheckpointError, RestoreFailed
  from train.init_from import InitError
  from train.loop import NonFiniteError
  from train.workdir_lock import WorkdirBusy
  from train import collector
  collector.settle()   # the libraries are imported: out of the garbage collector's walks

  import jax
  config = _CONFIG.value
  if _WORKDIR.value is None and jax.process_count() > 1:
    sys.exit('error: --workdir is required with several processes (each would pick its own '
             'default folder); give every process the same shared path')
  if added_flags and jax.process_index() == 0:
    print(f'xla flags   GPU training defaults (a flag set in XLA_FLAGS keeps its value): '
          f'{" ".join(added_flags)}')
  kind = 'plan' if _PLAN.value else 'dry-run'
  workdir = _WORKDIR.value or _default_workdir(
      config.name if target is None else f'{kind}-{config.name}-{target}')
  devices = None if compiled_target is None else _target_devices(compiled_target)
  try:
    if _PLAN.value:
      from plan.report import run_plan
      from plan.search import PlanError
      try:
        run_plan(config, target, workdir, ' '.join(['python', 'main.py', *sys.argv[1:]]),
                 stages=_PLAN_STAGES.value, allow_pure_bf16=_PLAN_ALLOW_PURE_BF16.value)
      except (PlanError, FileExistsError) as e:
        sys.exit(f'error: {e}')
      return
    from parallel.peers import PeerWatch
    checkpoint_dir = os.path.join(os.path.abspath(workdir), 'checkpoints')
    # With several processes, each stops within --peer_timeout of another one's loss.
    with PeerWatch(_PEER_TIMEOUT.value, checkpoint_dir) as watch:
      if _DRY_RUN.value:
        run.dry_run(config, workdir, devices, None if compiled_target is None else str(compiled_target))
      else:
        run.train_and_evaluate(config, workdir)
      watch.done()
  except RestoreFailed as e:   # not the checkpoint's fault: a temporary failure, start again
    sys.stderr.write(f'error: {e}\n')
    sys.exit(EXIT_LOST_PEER)
  except (checks.ConfigError, DataError, CheckpointError, InitError, WorkdirBusy,
          NonFiniteError) as e:
    sys.exit(f'error: {e}')
  print(f'outputs     {os.path.abspath(workdir)}')
  from parallel import distributed
  distributed.finish()


if __name__ == '__main__':
  app.run(main, flags_parser=_parse_flags)
