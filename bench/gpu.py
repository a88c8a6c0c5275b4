"""The GPU suite: one command that measures, on whatever single accelerator JAX sees, what only a GPU
shows, and writes it as `bench/results/gpu-<device>.json` and `.md`.

  python -m bench.gpu                      # the whole suite (resumes in its workdir)
  python -m bench.gpu --only='^1b_bf16'    # some cases (a regex over their names), and the claim
  python -m bench.gpu --smoke              # tiny shapes on any machine (a CPU): the plumbing

1. The cases (sweeps/gpu.py, run as a sweep: one process each, resumable): the 1b preset under
   every precision and quantization recipe and attention, the 7b preset with LoRA and QLoRA; step
   time, tokens/s, MFU of the datasheet peak (configs/hardware.py), the allocator's peak bytes
   beside the compiled figure and the analytic estimate on a GPU.
2. The classic claim, "a 20B model fine-tunes on one 24 GB GPU": `main.py --plan
   --target=1xRTX4090-24GB` on a 20B QLoRA config (the 20b preset, NF4 base drawn at random, since
   nothing is downloaded) chooses the recipe, which then runs a few steps in a process whose
   allocator may use 24 GB (XLA_PYTHON_CLIENT_MEM_FRACTION) and nothing more.
3. The goals the issue set (MFU >= 50 % in bf16 at 1b, fp8 >= 1.3x bf16 step speed, peak within
   10 % of the estimate), and the cost model's step times (plan/cost.py) against the measured ones,
   with the MFU it would have to assume to match them.

This process never touches the accelerator (its children do): it would hold memory they need.
"""
import datetime
import json
import os
import re
import shlex
import signal
import subprocess
import sys

from absl import app, flags

from bench.gpu_memory import card_environment, with_fraction
from bench.gpu_report import device_slug, goals, markdown, planner_summary, read_json

_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny shapes and few steps, on any machine (CI runs it '
                           'on a CPU).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the cases and the claim run (one folder '
                               'each); default runs/gpu-<device>[-smoke]. The same one resumes.')
_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Where gpu-<device>.json and .md go; default the '
                               'project\'s bench/results.')
_ONLY = flags.DEFINE_string('only', None, 'Run only the cases whose name matches this regex.')
_CLAIM = flags.DEFINE_bool('claim', True, 'Run the 20B-on-24GB claim too.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The claim: the model, its step and the card (`--smoke`: the tiny preset planned for a tiny card,
# run without a memory limit: a smoke run checks the plumbing).
CLAIM = {False: dict(config='configs/qlora.py:20b', batch_size=4, seq_len=1024,
                     target='1xRTX4090-24GB', steps=3),
         True: dict(config='configs/qlora.py:tiny', batch_size=4, seq_len=64, target='1x0.02GB',
                    steps=2)}
CASE_MEMORY_FRACTION = '0.95'   # of the device's memory, for each case's process
PROBE = ('import json, jax; d = jax.devices()[0]; s = d.memory_stats() or {}; '
         'print(json.dumps({"platform": d.platform, "device_kind": d.device_kind, '
         '"count": jax.device_count(), "bytes_limit": s.get("bytes_limit"), '
         '"jax": jax.__version__}))')


def probe_device() -> dict:
  """What the accelerator is, asked in a child process (with the allocator allowed the whole
  device, so that `bytes_limit` is what the device has)."""
  env = dict(with_fraction(os.environ, '1.0'), XLA_PYTHON_CLIENT_PREALLOCATE='false')
  done = subprocess.run([sys.executable, '-c', PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    from sweep.runner import last_error_line
    sys.exit(f'error: could not ask JAX for its device: {last_error_line(done.stderr + done.stdout)}')
  return json.loads(lines[-1])


def run_claim(directory: str, smoke: bool, device: dict) -> dict:
  """Plans the claim's config for its card, then runs the planned config for a few steps with the
  allocator limited to the card's memory. Each part is kept in `directory` and not redone. The
  parts run as the cases do, through sweep/runner.py's Runner: Ctrl-C stops the running one as it
  stops a sweep's points, and is raised once it has."""
  from sweep.runner import Runner
  runner = Runner(parallel=1)
  try:
    return _claim(runner, directory, smoke, device)
  except KeyboardInterrupt:
    runner.interrupt()
    raise


def _claim(runner, directory: str, smoke: bool, device: dict) -> dict:
  from plan.target import parse_target
  claim = CLAIM[smoke]
  target = parse_target(claim['target'])
  os.makedirs(directory, exist_ok=True)
  log = os.path.join(directory, 'log.txt')
  plan_dir = os.path.join(directory, 'plan')
  out = {'smoke': smoke, 'config': claim['config'], 'batch_size': claim['batch_size'],
         'seq_len': claim['seq_len'], 'target': claim['target'], 'card_bytes': target.memory,
         'log': log}
  if read_json(os.path.join(plan_dir, 'plan.json')) is None:
    if os.path.isdir(plan_dir):   # an interrupted plan: planning again refuses its leftovers
      import shutil
      shutil.rmtree(plan_dir)
    code, error = runner.run_logged(
        [sys.executable, 'main.py', f'--config={claim["config"]}',
         f'--config.train.batch_size={claim["batch_size"]}',
         f'--config.train.seq_len={claim["seq_len"]}', '--plan', f'--target={claim["target"]}',
         f'--workdir={plan_dir}'], log)
    if code:
      return {**out, 'status': 'plan failed', 'error': error}
  plan = read_json(os.path.join(plan_dir, 'plan.json'))
  out['plan'] = plan
  bench_path = os.path.join(directory, 'bench.json')
  env, out['memory_fraction'] = runner.env, None
  if not smoke and device['platform'] != 'cpu':   # its allocator gets the card's memory, no more
    try:
      env, out['memory_fraction'] = card_environment(runner.env, device, target.memory)
    except ValueError as e:
      return {**out, 'status': 'not run', 'error': str(e)}
  if read_json(bench_path) is None:
    code, error = runner.run_logged(
        [sys.executable, '-m', 'bench.train_step', f'--config={plan["config"]}',
         f'--steps={claim["steps"]}', '--warmup=1', *(['--matmul_size=256'] if smoke else []),
         f'--out={bench_path}'], log, env)
    if code:
      return {**out, 'status': 'failed', 'error': error}
  bench = read_json(bench_path)
  return {**out, 'status': 'done', 'bench': bench}


def case_pattern(sweep_spec: str, only: str) -> str:
  """The sweep's --only regex (over point names, `case=<name>`) for the cases whose name `only`
  matches; SweepError when it is not a regex or matches none."""
  from sweep import spec
  from sweep.grid import SweepError
  try:
    pattern = re.compile(only)
  except re.error as e:
    raise SweepError(f'--only={only!r} is not a regular expression: {e}') from None
  points = spec.load(sweep_spec).points
  chosen = [p.name for p in points if pattern.search(p.labels['case'])]
  if not chosen:
    raise SweepError(f'--only={only!r} matches none of the cases: '
                     f'{", ".join(p.labels["case"] for p in points)}')
  return '^(' + '|'.join(map(re.escape, chosen)) + ')$'


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]}')
  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, signal.default_int_handler)
  import jax
  jax.config.update('jax_platforms', 'cpu')   # this process only checks configs and plans
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  from data import DataError
  from configs.hardware import DEVICE_KINDS
  from sweep.grid import SweepError
  from sweep.session import run_sweep
  from train.workdir_lock import WorkdirBusy, workdir_lock

  device = probe_device()
  smoke = _SMOKE.value
  if device['platform'] == 'cpu' and not smoke:
    sys.exit('error: JAX sees no accelerator here (platform cpu): the full-size cases are for a '
             'GPU; run with --smoke to check the plumbing on a CPU')
  # The cases may use the device as a run that has it to itself would (JAX's default leaves a
  # quarter of it unused), unless the environment says otherwise; the claim sets its own limit.
  os.environ.update(with_fraction(os.environ, CASE_MEMORY_FRACTION, keep=True))
  slug = device_slug(device['device_kind'])
  directory = os.path.abspath(
      _WORKDIR.value or os.path.join('runs', f'gpu-{slug}{"-smoke" if smoke else ""}'))
  target = DEVICE_KINDS.get(device['device_kind'])
  sweep_spec = 'sweeps/gpu.py:' + ('smoke' if smoke else target or 'H100-80GB')
  command = ' '.join(['python -m bench.gpu', *map(shlex.quote, sys.argv[1:])])
  print(f'device      {device["count"]} x {device["device_kind"]} ({device["platform"]}), jax '
        f'{device["jax"]}' + ('' if target else '; no datasheet in configs/hardware.py, so no MFU'))
  if device['count'] > 1:
    print(f'note        the cases use one device of the {device["count"]}')
  try:
    only = None if _ONLY.value is None else case_pattern(sweep_spec, _ONLY.value)
    with workdir_lock(directory):
      _, table = run_sweep(sweep_spec, os.path.join(directory, 'cases'), command, only=only)
      claim = run_claim(os.path.join(directory, 'claim'), smoke, device) if _CLAIM.value else None
  except KeyboardInterrupt:
    sys.exit('interrupted: the same command resumes the suite')
  except (SweepError, DataError, WorkdirBusy) as e:
    sys.exit(f'error: {e}')
  rows = {r['case']: r for r in table if r['status'] == 'done'}
  results = {'command': command, 'date': datetime.date.today().isoformat(), 'smoke': smoke,
             'device': device, 'workdir': directory, 'cases': table,
             'goals': goals(rows, device['platform']), 'planner': planner_summary(rows),
             'claim': claim}
  out_dir = _OUT_DIR.value or os.path.join(ROOT, 'bench', 'results')
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, f'gpu-{slug}{"-smoke" if smoke else ""}')
  with open(stem + '.json', 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=2, default=str)
    f.write('\n')
  text = markdown(results)
  with open(stem + '.md', 'w', encoding='utf-8') as f:
    f.write(text)
  print(text)
  print(f'results     {stem}.json, {stem}.md')
  if any(r['status'] == 'failed' for r in table) or (claim and claim['status'] != 'done'):
    sys.exit(1)


if __name__ == '__main__':
  app.run(main)
