"""The deviceless compile checked against a real GPU: on a machine with one, what `main.py --dry_run
--target=1x<this GPU>` compiles (XLA:GPU on the CPU, for the description in configs/gpu_targets.py)
beside what the same step holds on the device (the allocator's peak and the attached compile), and
the device's own description (XLA's dump of it) beside the written one.

  python -m bench.target_check                       # every case, within --budget_s
  python -m bench.target_check --only='^1b_bf16'     # some cases (a regex over their names)
  python -m bench.target_check --smoke               # tiny shapes, any machine (on a CPU the
                                                     # "device" runs are the CPU's: the plumbing)

Writes `target-check-<device>.json` and `.md` to --out_dir (default bench/results), and the device's
dumped description as `target-config-<device>.txtpb`. The deviceless compiles run on the CPU while
the device runs the cases one at a time (each `bench.train_step` for a few steps, in a process of
its own, so that each peak is its own); a case not reached within the budget keeps its deviceless
figure alone.
"""
import concurrent.futures
import datetime
import glob
import json
import os
import re
import sys
import tempfile
import time

from absl import app, flags

from bench.gpu_report import device_slug, read_json
from configs.gpu_targets import description_differences

_ONLY = flags.DEFINE_string('only', None, 'Only the cases whose name matches this regex.')
_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny shapes (the plumbing, on any machine).')
_OUT_DIR = flags.DEFINE_string('out_dir', None, 'Where the results go; default bench/results.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the runs go; default a temporary folder.')
_BUDGET = flags.DEFINE_float('budget_s', 330, 'No device case starts after this many seconds.')
_PARALLEL = flags.DEFINE_integer('parallel', 3, 'Deviceless compiles at a time.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GiB = 2.0**30
# The suite's cases (sweeps/gpu.py) and three more of issue 46's: remat none, an offloaded
# optimizer, QLoRA; the device runs them in this order (the ones no earlier run measured first).
FIRST = ('1b_bf16_mixed', '1b_bf16_mixed_remat_none', '1b_bf16_master_offload', '7b_qlora')


def cases(smoke: bool) -> dict:
  from sweeps.gpu import cases as suite
  out = suite(smoke)
  out['1b_bf16_mixed_remat_none'] = {**out['1b_bf16_mixed'], 'model.remat': 'none'}
  out['1b_bf16_master_offload'] = {**out['1b_bf16_master'], 'parallel.offload_optimizer': True}
  order = [n for n in FIRST if n in out] + [n for n in out if n not in FIRST]
  return {name: out[name] for name in order}


def arguments(case: dict) -> list[str]:
  """A case's overrides as command-line flags."""
  return [f'--config={case["config"]}'] + [f'--config.{k}={v}' for k, v in case.items()
                                           if k != 'config']


PROBE = '''
import json, os, sys, jax, jax.numpy as jnp
d = jax.devices()[0]
def target_config_probe(x):
  return (x @ x).sum()
jax.jit(target_config_probe).lower(jnp.ones((256, 256), jnp.bfloat16)).compile()
s = d.memory_stats() or {}
print(json.dumps({"platform": d.platform, "device_kind": d.device_kind, "jax": jax.__version__,
                  "compute_capability": getattr(d, "compute_capability", None),
                  "core_count": getattr(d, "core_count", None), "bytes_limit": s.get("bytes_limit")}))
'''


def probe(directory: str) -> dict:
  """The device, and its description as XLA dumps it (None on a CPU)."""
  import subprocess
  dump = os.path.join(directory, 'probe-dump')
  # The persistent cache off: a probe loaded from it would dump nothing.
  env = {**os.environ, 'XLA_FLAGS': f'--xla_dump_to={dump} --xla_dump_hlo_module_re=.*probe.*',
         'XLA_PYTHON_CLIENT_PREALLOCATE': 'false', 'JAX_ENABLE_COMPILATION_CACHE': 'false'}
  done = subprocess.run([sys.executable, '-c', PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True)
  if done.returncode:
    sys.exit(f'error: could not ask JAX for its device: {done.stderr.strip().splitlines()[-1:]}')
  device = json.loads(done.stdout.strip().splitlines()[-1])
  files = sorted(glob.glob(os.path.join(dump, '*gpu_target_config.pbtxt')))
  device['target_config'] = open(files[0]).read() if files else None
  smi = subprocess.run(['nvidia-smi', '--query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem',
                        '--format=csv,noheader'], capture_output=True, text=True) \
      if device['platform'] == 'gpu' else None
  device['nvidia_smi'] = smi.stdout.strip() if smi is not None and not smi.returncode else None
  return device


def deviceless(runner, name: str, case: dict, target: str, directory: str) -> dict:
  workdir = os.path.join(directory, 'deviceless', name)
  start = time.perf_counter()
  code, error = runner.run_logged(
      [sys.executable, 'main.py', *arguments(case), '--dry_run', f'--target={target}',
       f'--workdir={workdir}'], os.path.join(directory, f'deviceless-{name}.log'),
      {**os.environ, 'TF_CPP_MIN_LOG_LEVEL': '3'})
  memory = read_json(os.path.join(workdir, 'memory.json')) or {}
  return {'deviceless_bytes': memory.get('per_device_bytes', {}).get('total'),
          'deviceless_host_bytes': memory.get('host_bytes', {}).get('total'),
          'estimate_gpu_bytes': memory.get('estimate_gpu_bytes', {}).get('total'),
          'compiler': memory.get('compiler'), 'deviceless_s': round(time.perf_counter() - start, 1),
          'deviceless_error': error or None}


def attached(runner, name: str, case: dict, directory: str, smoke: bool) -> dict:
  out = os.path.join(directory, f'bench-{name}.json')
  from parallel import xla_flags
  # The XLA flags a training run on the GPU gets (main.py), as the deviceless compile has them.
  env = {**os.environ, 'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.95', 'TF_CPP_MIN_LOG_LEVEL': '3',
         'XLA_FLAGS': xla_flags.merged(os.environ.get('XLA_FLAGS', ''))[0]}
  start = time.perf_counter()
  code, error = runner.run_logged(
      [sys.executable, '-m', 'bench.train_step', *arguments(case), '--steps=2', '--warmup=1',
       f'--matmul_size={256 if smoke else 1024}', f'--out={out}'],
      os.path.join(directory, f'bench-{name}.log'), env)
  bench = read_json(out) or {}
  return {'peak_bytes': bench.get('peak_device_bytes'),
          'attached_bytes': bench.get('per_device_bytes', {}).get('total'),
          'attached_s': round(time.perf_counter() - start, 1), 'attached_error': error or None}


def markdown(results: dict) -> str:
  device = results['device']
  lines = [f'# The deviceless compile against {device["device_kind"]}', '',
           f'`{results["command"]}` on {results["date"]}, jax {device["jax"]}; target '
           f'`{results["target"]}` compiled with XLA:GPU on the CPU (JAX_PLATFORMS=cpu).', '',
           '| case | deviceless (GiB) | attached compile (GiB) | allocator peak (GiB) | '
           'deviceless ÷ peak | GPU estimate (GiB) | earlier peak (GiB) |',
           '|---|---:|---:|---:|---:|---:|---:|']
  f = lambda v: '' if v is None else f'{v / GiB:.3f}'
  for name, r in results['cases'].items():
    ratio = (r['deviceless_bytes'] / r['peak_bytes'] if r.get('deviceless_bytes')
             and r.get('peak_bytes') else None)
    lines.append(f'| {name} | {f(r.get("deviceless_bytes"))} | {f(r.get("attached_bytes"))} | '
                 f'{f(r.get("peak_bytes"))} | {"" if ratio is None else f"{ratio:.4f}"} | '
                 f'{f(r.get("estimate_gpu_bytes"))} | {f(r.get("earlier_peak_bytes"))} |')
  if results.get('earlier'):
    lines += ['', f'Earlier peak: {results["earlier"]}']
  diffs = results.get('description_differences')
  lines += ['', 'The device\'s description (XLA\'s dump) against configs/gpu_targets.py: '
            + ('not dumped' if diffs is None else 'identical' if not diffs else '')]
  for d in diffs or ():
    lines.append(f'- `{d["field"]}`: written {d["written"]}, device {d["device"]}')
  return '\n'.join(lines) + '\n'


def main(argv):
  if len(argv) > 1:
    sys.exit(f'error: unexpected arguments {argv[1:]}')
  from configs.hardware import DEVICE_KINDS
  from plan.target import description, parse_target
  from parallel.target import library_versions
  from sweep.runner import Runner
  started = time.perf_counter()
  directory = _WORKDIR.value or tempfile.mkdtemp(prefix='target-check-')
  os.makedirs(directory, exist_ok=True)
  device = probe(directory)
  if device['platform'] == 'cpu' and not _SMOKE.value:
    sys.exit('error: JAX sees no GPU here: the device part needs one; --smoke runs the plumbing')
  name = DEVICE_KINDS.get(device['device_kind'], 'H100-80GB')
  target = f'1x{name}'
  chosen = {n: c for n, c in cases(_SMOKE.value).items()
            if _ONLY.value is None or re.search(_ONLY.value, n)}
  if not chosen:
    sys.exit(f'error: --only={_ONLY.value!r} matches none of {", ".join(cases(_SMOKE.value))}')
  written = description(parse_target(target)).target_config(**library_versions())
  results = {'command': ' '.join(['python -m bench.target_check', *sys.argv[1:]]),
             'date': datetime.date.today().isoformat(), 'target': target,
             'device': {k: v for k, v in device.items() if k != 'target_config'},
             'written_target_config': written, 'device_target_config': device['target_config'],
             'description_differences': (None if device['target_config'] is None else
                                         description_differences(written, device['target_config'])),
             'cases': {n: {} for n in chosen}}
  out_dir = _OUT_DIR.value or os.path.join(ROOT, 'bench', 'results')
  os.makedirs(out_dir, exist_ok=True)
  slug = device_slug(device['device_kind'])
  if device['target_config']:
    with open(os.path.join(out_dir, f'target-config-{slug}.txtpb'), 'w', encoding='utf-8') as f:
      f.write(device['target_config'])
  stem = os.path.join(out_dir, f'target-check-{slug}' + ('-smoke' if _SMOKE.value else ''))
  runner = Runner(parallel=1)
  with concurrent.futures.ThreadPoolExecutor(_PARALLEL.value) as pool:
    futures = {n: pool.submit(deviceless, runner, n, c, target, directory) for n, c in chosen.items()}
    for n, c in chosen.items():
      if time.perf_counter() - started > _BUDGET.value:
        continue
      results['cases'][n].update(attached(runner, n, c, directory, _SMOKE.value))
      print(f'device      {n}: {results["cases"][n]}', flush=True)
      _write(stem, results)   # what is measured is kept, should the call be cut short
    for n, future in futures.items():
      results['cases'][n].update(future.result())
  text = _write(stem, results)
  print(text)
  print(f'results     {stem}.json, {stem}.md ({time.perf_counter() - started:.0f} s)')


def _write(stem: str, results: dict) -> str:
  with open(stem + '.json', 'w', encoding='utf-8') as f:
    json.dump(results, f, indent=2)
    f.write('\n')
  text = markdown(results)
  with open(stem + '.md', 'w', encoding='utf-8') as f:
    f.write(text)
  return text

if __name__ == '__main__':
  app.run(main)
