"""`main.py --plan`: print the ranked recipes, verify the fastest by compiling, and write the chosen
one as a config file that runs as-is."""
import datetime
import json
import os
import pprint
import subprocess
import sys
import tempfile

from memory.compiled import compiler_of
from plan.search import MARGIN, apply, assumptions, plan
from plan.target import Target

TOP = 10
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gb(n: float) -> str:
  return f'{n / 1e9:.1f} GB'


def verifier() -> str:
  """The compiler that verifies a plan: XLA:GPU for the target's GPUs where the CUDA plugin is
  installed (parallel/target.py), else XLA:CPU on as many simulated devices; as `gpu` or `cpu`."""
  from parallel.target import plugin
  return 'gpu' if plugin() else 'cpu'


def compile_total(config, target: Target, backend: str) -> int | str | None:
  """The compiled per-device peak of `config` on the target (its train step's total, or creating
  its state where that needs more: a plan whose state cannot be created does not fit), or why it
  did not compile: with XLA:GPU for the target's GPUs (`backend` gpu) or XLA:CPU on as many
  simulated devices (cpu). Each compile is `main.py --dry_run` of the config file in a child
  process: XLA can abort on a layout it cannot compile, which must not take the plan down."""
  with tempfile.TemporaryDirectory() as tmp:
    path = os.path.join(tmp, 'candidate.py')
    write_config(path, config, 'A plan candidate.')
    # XLA's partitioner warnings are not ours; and the compile runs on the CPU even on a machine
    # with accelerators (whose count is not the target's).
    env = {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '3', 'JAX_PLATFORMS': 'cpu'}
    devices = f'--target={target}' if backend == 'gpu' else f'--host_devices={target.count}'
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, 'main.py'), f'--config={path}', '--dry_run', devices,
         f'--workdir={os.path.join(tmp, "w")}'],
        cwd=ROOT, env=env, capture_output=True, text=True)
    if done.returncode:
      lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
      failure = next((line for line in lines if line.startswith(('F1', 'error:')) or 'Error:' in line),
                     lines[-1] if lines else '')
      return f'did not compile ({failure.strip()[:160]})'
    with open(os.path.join(tmp, 'w', 'memory.json')) as f:
      memory = json.load(f)
    total = memory.get('per_device_bytes', {}).get('total')   # None: plan() says so
    # What the step writes to host memory (an offloaded optimizer's new state) XLA:CPU keeps in
    # device temp; on a GPU it is host memory (and XLA:GPU reports it apart).
    if total is not None and backend == 'cpu':
      total -= memory.get('host_bytes', {}).get('outputs', 0)
    creation = memory.get('init_bytes', {}).get('peak')
    return total if total is None or creation is None else max(total, creation)


def write_config(path: str, config, header: str) -> None:
  """A self-contained config file: the whole resolved config as data."""
  if os.path.exists(path):
    raise FileExistsError(f'{path} already exists; choose a new --workdir')
  body = pprint.pformat(config.to_dict(), indent=1, width=100, sort_dicts=True)
  with open(path, 'w') as f:
    f.write(f'"""{header}\n"""\nimport ml_collections\n\nCONFIG = {body}\n\n\n'
            f'def get_config(preset=None):\n  del preset   # the plan fixed the model\n'
            f'  return ml_collections.ConfigDict(CONFIG)\n')


def run_plan(config, target: Target, workdir: str, command: str, stages: bool = True,
             allow_pure_bf16: bool = False) -> str:
  """Returns the path of the written config. `stages`: pipeline stages may be chosen;
  `allow_pure_bf16`: so may recipes without an fp32 master (plan/search.py)."""
  from train.checks import follow_tokenizer
  path = os.path.join(workdir, 'planned_config.py')
  if os.path.exists(path):   # refused before minutes of compiles, not after
    raise FileExistsError(f'{path} already exists; choose a new --workdir')
  config, _ = follow_tokenizer(config)
  print(f'plan        {config.name} on {target}: batch {config.train.batch_size} x '
        f'{config.train.seq_len} tokens per step')
  print(f'            {assumptions(target)}')
  backend = verifier()
  import jax
  print(f'            verified by compiling with {compiler_of(backend)} {jax.__version__} '
        + ('for the target\'s GPUs (compile-only devices)' if backend == 'gpu' else
           f'on {target.count} simulated CPU devices (XLA:GPU needs the CUDA plugin: pip install -r '
           f'requirements-gpu-compile.txt); the estimate ranks as that compiler holds the step'))
  chosen, ranked = plan(config, target, lambda c: compile_total(c, target, backend),
                        log=lambda line: print(f'            {line}', flush=True), stages=stages,
                        allow_pure_bf16=allow_pure_bf16, backend=backend)
  print(f'\n| rank | recipe | estimate per device | host memory per node | step time (estimate) | '
        f'compute | DP comm | TP comm | pipeline comm | context comm | host transfer '
        f'| compiled per device |')
  print('|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|')
  for i, c in enumerate(ranked[:TOP], 1):
    s = c.seconds
    compiled = (_gb(c.compiled) if isinstance(c.compiled, (int, float)) else
                'not compiled' if c.compiled is None else 'failed')
    host = c.host.get('total', 0) * min(target.count, target.per_node)
    print(f'| {i} | {c.recipe} | {_gb(c.device_bytes)} | {_gb(host)} | {s["total"]:.2f} s | '
          f'{s["compute"]:.2f} s | {s["data_parallel_comm"]:.2f} s | {s["tensor_comm"]:.2f} s | '
          f'{s["pipeline_comm"]:.2f} s | {s["context_comm"]:.2f} s | {s["host_transfer"]:.2f} s '
          f'| {compiled} |')
  tokens = config.train.batch_size * config.train.seq_len
  os.makedirs(workdir, exist_ok=True)
  planned = apply(config, chosen.recipe, target.count)
  planned.name = f'planned:{config.name}@{target}'
  planned.host_devices = 0
  header = (f'Planned on {datetime.date.today()} by\n  {command}\n\n'
            f'{chosen.recipe}\non {target}: compiled {_gb(chosen.compiled)} per device (estimate '
            f'{_gb(chosen.device_bytes)}; usable {_gb(target.memory * (1 - MARGIN))}), '
            f'estimated {chosen.seconds["total"]:.2f} s per step, '
            f'{tokens / chosen.seconds["total"]:,.0f} tokens/s.\n\n'
            f'Run it on the target:  python main.py --config={path}\n'
            f'Size it here:          python main.py --config={path} --dry_run '
            + (f'--target={target}' if backend == 'gpu' else f'--host_devices={target.count}'))
  write_config(path, planned, header)
  with open(os.path.join(workdir, 'plan.json'), 'w', encoding='utf-8') as f:
    json.dump({'target': str(target), 'recipe': str(chosen.recipe), 'config': path,
               'compiled_bytes': chosen.compiled, 'estimate_bytes': chosen.device_bytes,
               'compiler': f'{compiler_of(backend)} {jax.__version__}',
               'host_bytes_per_node': chosen.host.get('total', 0) * min(target.count,
                                                                         target.per_node),
               'step_seconds': chosen.seconds['total'], 'seconds': chosen.seconds,
               'tokens_per_sec': tokens / chosen.seconds['total']}, f, indent=2)
    f.write('\n')
  print(f'\nchosen      {chosen.recipe}: compiled {_gb(chosen.compiled)} per device, estimated '
        f'{chosen.seconds["total"]:.2f} s per step ({tokens / chosen.seconds["total"]:,.0f} tokens/s)')
  print(f'config      {path}')
  return path
