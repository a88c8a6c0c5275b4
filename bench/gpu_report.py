"""The GPU suite's report (bench/gpu.py runs the suite): the issue's goals judged against the
cases, the cost model's calibration, and the markdown of `bench/results/gpu-<device>.md`. Pure
functions of the results, so that they are tested on made-up figures without a GPU."""
import json
import re
import statistics

GB = 1e9
GOAL_MFU, GOAL_FP8_SPEEDUP, GOAL_PEAK_ERROR = 0.50, 1.3, 0.10


def read_json(path: str) -> dict | None:
  """A results file, or None where it is missing or unreadable (a part that has not run)."""
  try:
    with open(path, encoding='utf-8') as f:
      return json.load(f)
  except (OSError, ValueError):
    return None


def device_slug(device_kind: str) -> str:
  """`NVIDIA H100 80GB HBM3` -> `nvidia-h100-80gb-hbm3`: the results' file name."""
  return re.sub(r'[^a-z0-9]+', '-', device_kind.lower()).strip('-') or 'device'


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


def _fmt(value, digits=3, scale=1.0, unit='') -> str:
  if value is None:
    return ''
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return f'{value * scale:,.{digits}f}{unit}'
  return str(value)


CASE_COLUMNS = (   # (key, header, digits, scale)
    ('attention', 'attention', 0, 1), ('step_ms', 'step (ms)', 1, 1),
    ('tokens_per_sec', 'tokens/s', 0, 1), ('mfu_peak', 'MFU of the bf16 peak (%)', 1, 100),
    ('mfu_peak_causal', 'MFU, causal count (%)', 1, 100),
    ('mfu_peak_fp8', 'MFU of the fp8 peak (%, fp8 cases)', 1, 100),
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
              f', {device["bytes_limit"] / GB:.1f} GB on the device') + '.'
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
            'MFU: model FLOPs (6 per weight, 4 with a frozen LoRA base, plus attention over every '
            'pair as PaLM counts it, or over half of them by the causal count; no remat '
            'recompute) against the dense bf16 peak of configs/hardware.py, fp8 and int8 too. '
            'Modelled: plan/cost.py for the same recipe on this GPU.', '',
            '| case | status | ' + ' | '.join(h for _, h, _, _ in CASE_COLUMNS) + ' |',
            '|---|---|' + ''.join('---|' if k == 'attention' else '---:|'
                                  for k, _, _, _ in CASE_COLUMNS)]
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
  if claim.get('memory_fraction'):
    limit = (f'the allocator limited to the card\'s {claim["card_bytes"] / GB:.0f} GB (memory '
             f'fraction {claim["memory_fraction"]}'
             + (f': {reported / GB:.2f} GB as the device reports it' if reported else '') + ')')
  else:
    limit = ('no memory limit (' + ('a smoke run' if claim.get('smoke') else
                                    f'a {device["platform"]} has no allocator to limit') + ')')
  if claim['status'] == 'done':
    peak = bench.get('peak_device_bytes')
    estimate = bench['estimate_gpu_bytes']['total']
    lines.append(f'Ran {bench["steps"]} steps with {limit}: {bench["step_seconds"]:.2f} s per step, '
                 f'{bench["tokens_per_sec"]:,.0f} tokens/s, loss {bench["loss"]:.3f} nats/token; '
                 + (f'peak {peak / GB:.2f} GB of {claim["card_bytes"] / GB:.0f} GB: it fits '
                    f'(GPU estimate {estimate / GB:.2f} GB, peak ÷ estimate {peak / estimate:.3f}; '
                    f'the peak is the allocator\'s, the CUDA context and libraries are outside '
                    f'it, as they are beside the 24 GiB, 25.8e9 bytes, of an RTX 4090).'
                    if peak is not None else
                    f'no peak reported (GPU estimate {estimate / GB:.2f} GB).'))
  elif claim['status'] == 'not run':
    lines.append(f'Not run: {claim.get("error", "")}.')
  else:
    lines.append(f'{claim["status"]} with {limit}: {claim.get("error", "")} (log: {claim["log"]}).')
  return lines
