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
import statistics
import subprocess
import sys

from absl import app, flags

_SMOKE = flags.DEFINE_bool('smoke', False, 'Tiny shapes and few steps, on any machine (CI runs it '
                           'on a CPU).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'Where the cases and the claim run (one folder '
                               'each); default runs/gpu-<device>[-smoke]. The same one resumes.')
_OUT_DIR = flags.DEFINE_string('out_dir', 'bench/results', 'Where gpu-<device>.json and .md go.')
_ONLY = flags.DEFINE_string('only', None, 'Run only the cases whose name matches this regex.')
_CLAIM = flags.DEFINE_bool('claim', True, 'Run the 20B-on-24GB claim too.')

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GB = 1e9
# The claim: the model, its step and the card (`--smoke`: the tiny preset on a card it fits).
CLAIM = {False: dict(config='configs/qlora.py:20b', batch_size=4, seq_len=1024,
                     target='1xRTX4090-24GB', steps=3),
         True: dict(config='configs/qlora.py:tiny', batch_size=4, seq_len=64, target='1x0.02GB',
                    steps=2)}
GOAL_MFU, GOAL_FP8_SPEEDUP, GOAL_PEAK_ERROR = 0.50, 1.3, 0.10
PROBE = ('import json, jax; d = jax.devices()[0]; s = d.memory_stats() or {}; '
         'print(json.dumps({"platform": d.platform, "device_kind": d.device_kind, '
         '"count": jax.device_count(), "bytes_limit": s.get("bytes_limit"), '
         '"jax": jax.__version__}))')


def probe_device() -> dict:
  """What the accelerator is, asked in a child process (with the allocator allowed the whole
  device, so that `bytes_limit` is what the device has)."""
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE='false', XLA_PYTHON_CLIENT_MEM_FRACTION='1.0')
  done = subprocess.run([sys.executable, '-c', PROBE], cwd=ROOT, env=env, capture_output=True,
                        text=True)
  lines = done.stdout.strip().splitlines()
  if done.returncode or not lines:
    from sweep.runner import last_error_line
    sys.exit(f'error: could not ask JAX for its device: {last_error_line(done.stderr + done.stdout)}')
  return json.loads(lines[-1])


def device_slug(device_kind: str) -> str:
  """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`: the results' file name."""
  return re.sub(r'[^a-z0-9]+', '-', device_kind.lower()).strip('-') or 'device'


def _run_logged(argv: list[str], log_path: str, env: dict | None = None) -> tuple[int, str]:
  """Runs `argv` in the project root with its output appended to `log_path`; (exit status, the
  line that says why it failed, or '')."""
  from sweep.runner import last_error_line
  with open(log_path, 'a', encoding='utf-8') as log:
    log.write(f'\n=== {datetime.datetime.now().isoformat(timespec="seconds")}: '
              f'{" ".join(map(shlex.quote, argv))}\n')
    log.flush()
    offset = log.tell()
    child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
    try:
      returncode = child.wait()
    except KeyboardInterrupt:
      os.killpg(child.pid, signal.SIGTERM)
      child.wait()
      raise
  if not returncode:
    return 0, ''
  with open(log_path, encoding='utf-8', errors='replace') as f:
    f.seek(offset)
    return returncode, last_error_line(f.read())


def _read_json(path: str) -> dict | None:
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def run_claim(directory: str, smoke: bool, device: dict) -> dict:
  """Plans the claim's config for its card, then runs the planned config for a few steps with the
  allocator limited to the card's memory. Each part is kept in `directory` and not redone."""
  from plan.target import parse_target
  claim = CLAIM[smoke]
  target = parse_target(claim['target'])
  os.makedirs(directory, exist_ok=True)
  log = os.path.join(directory, 'log.txt')
  plan_dir = os.path.join(directory, 'plan')
  out = {'config': claim['config'], 'batch_size': claim['batch_size'],
         'seq_len': claim['seq_len'], 'target': claim['target'], 'card_bytes': target.memory,
         'log': log}
  if _read_json(os.path.join(plan_dir, 'plan.json')) is None:
    if os.path.isdir(plan_dir):   # an interrupted plan: planning again refuses its leftovers
      import shutil
      shutil.rmtree(plan_dir)
    code, error = _run_logged(
        [sys.executable, 'main.py', f'--config={claim["config"]}',
         f'--config.train.batch_size={claim["batch_size"]}',
         f'--config.train.seq_len={claim["seq_len"]}', '--plan', f'--target={claim["target"]}',
         f'--workdir={plan_dir}'], log)
    if code:
      return {**out, 'status': 'plan failed', 'error': error}
  plan = _read_json(os.path.join(plan_dir, 'plan.json'))
  out['plan'] = plan
  bench_path = os.path.join(directory, 'bench.json')
  env = dict(os.environ)
  limited = device['platform'] != 'cpu' and device.get('bytes_limit')
  if limited:   # this process's allocator gets the card's memory and no more
    env['XLA_PYTHON_CLIENT_MEM_FRACTION'] = f'{min(target.memory / device["bytes_limit"], 1.0):.4f}'
    env['XLA_PYTHON_CLIENT_PREALLOCATE'] = 'true'
  out['memory_fraction'] = env.get('XLA_PYTHON_CLIENT_MEM_FRACTION') if limited else None
  if _read_json(bench_path) is None:
    code, error = _run_logged(
        [sys.executable, '-m', 'bench.train_step', f'--config={plan["config"]}',
         f'--steps={claim["steps"]}', '--warmup=1', f'--out={bench_path}'], log, env)
    if code:
      return {**out, 'status': 'failed', 'error': error}
  bench = _read_json(bench_path)
  return {**out, 'status': 'done', 'bench': bench}


def goals(rows: dict, platform: str) -> list[dict]:
  """The issue's goals against the cases that finished; judged on a GPU only."""
  judged = platform == 'gpu'
  verdict = lambda ok: ('pass' if ok else 'FAIL') if judged else f'not judged ({platform})'
  out = []
  bf16 = rows.get('1b_bf16_mixed')
  mfu = bf16 and bf16.get('mfu_peak')
  out.append({'goal': f'MFU >= {GOAL_MFU:.0%} of the datasheet peak in bf16 at 1b (MaxText: ~50 % '
                      f'for Llama2-7B on H100)',
              'value': mfu, 'verdict': verdict(mfu >= GOAL_MFU) if mfu is not None else 'no figure'})
  fp8 = rows.get('1b_fp8')
  speedup = (bf16['step_ms'] / fp8['step_ms'] if bf16 and fp8 and bf16.get('step_ms')
             and fp8.get('step_ms') else None)
  out.append({'goal': f'fp8 >= {GOAL_FP8_SPEEDUP}x bf16 step speed (torchtitan: 1.28x)',
              'value': speedup,
              'verdict': verdict(speedup >= GOAL_FP8_SPEEDUP) if speedup else 'no figure'})
  ratios = {name: r['peak_vs_estimate'] for name, r in rows.items()
            if r.get('peak_vs_estimate') is not None}
  worst = max(ratios.items(), key=lambda kv: abs(kv[1] - 1), default=None)
  out.append({'goal': f'peak memory within {GOAL_PEAK_ERROR:.0%} of the GPU estimate (every case)',
              'value': worst and worst[1], 'worst_case': worst and worst[0],
              'verdict': (verdict(abs(worst[1] - 1) <= GOAL_PEAK_ERROR) if worst
                          else 'no figure')})
  return out


def planner_summary(rows: dict) -> dict:
  """The cost model against the measured steps: the MFU it would need, per case and in the median
  over the cases without quantized matmuls or a frozen base (what MFU_ASSUMED stands for)."""
  from plan.cost import MFU_ASSUMED
  calibrated = {name: r['calibrated_mfu'] for name, r in rows.items()
                if r.get('calibrated_mfu') is not None}
  plain = [v for name, v in calibrated.items()
           if not re.search(r'fp8|int8|lora', name)]
  return {'mfu_assumed': MFU_ASSUMED, 'calibrated_mfu': calibrated,
          'calibrated_mfu_median': statistics.median(plain) if plain else None}


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


def _fmt(value, digits=3, scale=1.0, unit='') -> str:
  if value is None:
    return ''
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return f'{value * scale:,.{digits}f}{unit}'
  return str(value)


CASE_COLUMNS = (   # (key, header, digits, scale)
    ('attention', 'attention', 0, 1), ('step_ms', 'step (ms)', 1, 1),
    ('tokens_per_sec', 'tokens/s', 0, 1), ('mfu_peak', 'MFU of the bf16 peak (%)', 1, 100),
    ('peak_gb', 'peak (GB)', 2, 1), ('compiled_gb', 'compiled (GB)', 2, 1),
    ('estimate_gpu_gb', 'GPU estimate (GB)', 2, 1), ('peak_vs_estimate', 'peak ÷ estimate', 3, 1),
    ('modelled_step_s', 'modelled step (ms)', 1, 1e3),
    ('modelled_vs_measured', 'modelled ÷ measured', 3, 1),
    ('calibrated_mfu', 'MFU the cost model needs (%)', 1, 100))


def markdown(results: dict) -> str:
  device, claim = results['device'], results.get('claim')
  lines = [f'# GPU suite: {device["device_kind"]}', '',
           f'`{results["command"]}` on {results["date"]}: {device["count"]} x '
           f'{device["device_kind"]} ({device["platform"]}), jax {device["jax"]}'
           + ('' if device.get('bytes_limit') is None else
              f', {device["bytes_limit"] / GB:.1f} GB usable per device') + '.'
           + (' **Smoke run: tiny shapes, the figures say nothing about speed.**'
              if results['smoke'] else ''), '',
           '## Goals', '', '| goal | measured | verdict |', '|---|---:|---|']
  for g in results['goals']:
    value = g['value']
    if value is None:
      shown = ''
    elif 'MFU' in g['goal']:
      shown = f'{value:.1%}'
    else:
      shown = f'{value:.3f}' + (f' ({g["worst_case"]})' if g.get('worst_case') else '')
    lines.append(f'| {g["goal"]} | {shown} | {g["verdict"]} |')
  lines += ['', '## Cases', '',
            'One process per case (bench.train_step, random tokens, one device); GB = 1e9 bytes. '
            'Peak: the allocator\'s peak bytes in use over the process (initialisation included); '
            'compiled: XLA\'s memory analysis of the step; estimate: memory/estimate.py on a GPU. '
            'MFU: model FLOPs (6 per weight, 4 with a frozen LoRA base, plus attention; no remat '
            'recompute) against the dense bf16 peak of configs/hardware.py, fp8 and int8 too. '
            'Modelled: plan/cost.py for the same recipe on this GPU.', '',
            '| case | status | ' + ' | '.join(h for _, h, _, _ in CASE_COLUMNS) + ' |',
            '|---|---|' + '---:|' * len(CASE_COLUMNS)]
  for row in results['cases']:
    cells = [_fmt(row.get(k), d, s) for k, _, d, s in CASE_COLUMNS]
    lines.append(f'| {row["case"]} | {row["status"]} | ' + ' | '.join(cells) + ' |')
  failed = [r for r in results['cases'] if r['status'] not in ('done', 'not run')]
  lines += [f'- `{r["case"]}` {r["status"]}: {r.get("error", "")}' for r in failed]
  planner = results['planner']
  lines += ['', '## The cost model against the measurements', '',
            f'plan/cost.py assumes {planner["mfu_assumed"]:.0%} MFU for every recipe. '
            + ('The median MFU it would need to match the cases without quantized matmuls or a '
               f'frozen base here: {planner["calibrated_mfu_median"]:.1%}.'
               if planner['calibrated_mfu_median'] is not None else
               'No case ran on a GPU the cost model knows, so there is nothing to compare.')]
  if claim:
    lines += ['', '## The claim: a 20B model fine-tuned on one 24 GB GPU'
              + (' (smoke: the tiny preset on a tiny card)' if results['smoke'] else ''), '',
              *claim_lines(claim, device)]
  return '\n'.join(lines) + '\n'


def claim_lines(claim: dict, device: dict) -> list[str]:
  plan = claim.get('plan') or {}
  lines = [f'`main.py --config={claim["config"]} --config.train.batch_size={claim["batch_size"]} '
           f'--config.train.seq_len={claim["seq_len"]} --plan --target={claim["target"]}`'
           + (f' chose: {plan["recipe"]}; compiled (XLA:CPU) {plan["compiled_bytes"] / GB:.2f} '
              f'GB, estimate {plan["estimate_bytes"] / GB:.2f} GB per device, modelled '
              f'{plan["step_seconds"]:.2f} s per step.' if plan else '.')]
  bench = claim.get('bench') or {}
  reported = bench.get('device_bytes_limit')
  limit = (f'the allocator limited to the card\'s {claim["card_bytes"] / GB:.0f} GB '
           f'(XLA_PYTHON_CLIENT_MEM_FRACTION={claim["memory_fraction"]}'
           + (f': {reported / GB:.2f} GB as the device reports it' if reported else '') + ')'
           if claim.get('memory_fraction') else
           f'no memory limit (a {device["platform"]} has no allocator to limit)')
  if claim['status'] == 'done':
    peak = bench.get('peak_device_bytes')
    estimate = bench['estimate_gpu_bytes']['total']
    lines.append(f'Ran {bench["steps"]} steps with {limit}: {bench["step_seconds"]:.2f} s per step, '
                 f'{bench["tokens_per_sec"]:,.0f} tokens/s, loss {bench["loss"]:.3f} nats/token; '
                 + (f'peak {peak / GB:.2f} GB of {claim["card_bytes"] / GB:.0f} GB: it fits '
                    f'(GPU estimate {estimate / GB:.2f} GB, peak ÷ estimate '
                    f'{peak / estimate:.3f}).' if peak is not None else
                    f'no peak reported (GPU estimate {estimate / GB:.2f} GB).'))
  else:
    lines.append(f'{claim["status"]} with {limit}: {claim.get("error", "")} (log: {claim["log"]}).')
  return lines


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
  slug = device_slug(device['device_kind'])
  directory = _WORKDIR.value or os.path.join('runs', f'gpu-{slug}{"-smoke" if smoke else ""}')
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
             'device': device, 'workdir': os.path.abspath(directory), 'cases': table,
             'goals': goals(rows, device['platform']), 'planner': planner_summary(rows),
             'claim': claim}
  os.makedirs(_OUT_DIR.value, exist_ok=True)
  stem = os.path.join(_OUT_DIR.value, f'gpu-{slug}{"-smoke" if smoke else ""}')
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
