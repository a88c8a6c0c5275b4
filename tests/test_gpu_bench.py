"""The GPU suite (bench/gpu.py): its smoke mode end to end on this machine's CPU (the cases as a
sweep, the claim planned and run, the results written, a re-run resuming), and the parts that only
a GPU's figures reach (the goals, the cost model's calibration, the claim's report) on figures made
up for the test."""
import json
import os
import subprocess

import pytest

from bench import gpu_memory, gpu_report
from configs.hardware import GPUS
from plan.cost import MFU_ASSUMED, Recipe, step_seconds
from plan.target import Target
from precision.policy import get_policy
from sweep.metrics import METRICS, PointFiles
from tests.helpers import python, tiny_config
from tests.test_docs import run_documented
from train.checks import model_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASE = '1b_bf16_mixed'   # the one case docs/gpu.md's command runs; the claim is a QLoRA run


def _suite(directory) -> str:
  """docs/gpu.md's command in `directory` (the smoke suite's case CASE and the claim; workdir
  runs/gpu-cpu-smoke, results in results/): run once for the guide and this test."""
  return run_documented('docs/gpu.md', 'python -m bench.gpu', directory)


def test_the_smoke_suite_measures_plans_and_runs_the_claim_then_resumes(tmp_path):
  _suite(tmp_path)
  with open(tmp_path / 'results' / 'gpu-cpu-smoke.json') as f:
    results = json.load(f)
  assert results['device']['platform'] == 'cpu' and results['smoke']
  cases = {row['case']: row for row in results['cases']}
  assert len(cases) == 9   # every case is listed; the one asked for ran
  assert [name for name, row in cases.items() if row['status'] == 'done'] == [CASE]
  row = cases[CASE]
  for key in ('step_ms', 'tokens_per_sec', 'mfu', 'compiled_gb', 'estimate_gpu_gb',
              'modelled_step_s', 'params_m', 'trainable_m'):
    assert row[key] > 0, (key, row)
  # A CPU has no datasheet peak and reports no allocator peak: those stay empty, not invented.
  for key in ('mfu_peak', 'peak_gb', 'peak_vs_estimate', 'modelled_vs_measured', 'calibrated_mfu'):
    assert row[key] is None, (key, row)
  assert row['attention'] == 'flash'
  assert [g['verdict'] for g in results['goals']] == ['no figure', 'no figure', 'no figure']
  claim = results['claim']
  assert claim['status'] == 'done' and claim['memory_fraction'] is None
  assert claim['plan']['recipe'].startswith('bf16') and os.path.isfile(claim['plan']['config'])
  bench = claim['bench']   # the planned QLoRA config, run: only its adapters train
  assert bench['steps'] == 2 and bench['lora_rank'] > 0 and not bench['base_trains']
  assert 0 < bench['trainable_params'] < bench['num_params'] / 10
  with open(tmp_path / 'results' / 'gpu-cpu-smoke.md') as f:
    text = f.read()
  for heading in ('## Goals', '## Cases', '## The cost model against the measurements',
                  '## The claim'):
    assert heading in text
  # The same command again: nothing runs twice (every case and the claim keep their one attempt).
  again = _suite(tmp_path)
  assert '0 to run' in again
  workdir = tmp_path / 'runs' / 'gpu-cpu-smoke'
  for log in (workdir / 'cases' / 'runs' / f'case={CASE}' / 'log.txt', workdir / 'claim' / 'log.txt'):
    attempts = log.read_text().count('\n=== ')
    assert attempts == (1 if 'cases' in str(log) else 2), log   # the claim: its plan and its run


def test_a_pattern_that_matches_nothing_and_a_cpu_without_smoke_are_refused(tmp_path):
  done = subprocess.run([*python(os.environ), '-m', 'bench.gpu', '--smoke', '--only=70b',
                         f'--workdir={tmp_path / "w"}', f'--out_dir={tmp_path / "out"}'],
                        cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1].startswith(
      "error: --only='70b' matches none of the cases: 1b_bf16_mixed, ")
  assert not (tmp_path / 'w').exists() and not (tmp_path / 'out').exists()
  # Without --smoke the full-size cases are for an accelerator: refused on a CPU.
  done = subprocess.run([*python(os.environ), '-m', 'bench.gpu', f'--workdir={tmp_path / "w"}',
                         f'--out_dir={tmp_path / "out"}'], cwd=ROOT, capture_output=True,
                        text=True, timeout=300)
  assert done.returncode != 0
  assert done.stderr.strip().splitlines()[-1].startswith('error: JAX sees no accelerator here')
  assert not (tmp_path / 'w').exists() and not (tmp_path / 'out').exists()


def _row(step_ms, mfu_peak=None, peak_vs_estimate=None):
  return {'status': 'done', 'step_ms': step_ms, 'mfu_peak': mfu_peak,
          'peak_vs_estimate': peak_vs_estimate}


def test_the_goals_are_judged_on_a_gpu_and_only_there():
  rows = {'1b_bf16_mixed': _row(100.0, 0.52, 1.04), '1b_fp8': _row(80.0, 0.65, 0.93),
          '7b_lora': _row(300.0, 0.3, 1.12)}
  mfu, fp8, peak = gpu_report.goals(rows, 'gpu')
  assert (mfu['value'], mfu['verdict']) == (0.52, 'pass')
  assert fp8['value'] == pytest.approx(1.25) and fp8['verdict'] == 'FAIL'   # 100 / 80 < 1.3
  assert (peak['worst_case'], peak['verdict']) == ('7b_lora', 'FAIL')        # 12 % above
  rows['7b_lora'] = _row(300.0, 0.3, 1.08)
  assert gpu_report.goals(rows, 'gpu')[2]['verdict'] == 'pass'
  assert {g['verdict'] for g in gpu_report.goals(rows, 'cpu')} == {'not judged (cpu)'}
  assert [g['verdict'] for g in gpu_report.goals({}, 'gpu')] == ['no figure'] * 3


def _bench_point(tmp_path, device_kind, config, step_seconds_measured):
  """A finished bench point's workdir, as bench.train_step writes it, with made-up timings."""
  bench = {'device_kind': device_kind, 'mesh': {'stage': 1, 'data': 1, 'fsdp': 1, 'tensor': 1},
           'step_seconds': step_seconds_measured,
           'tokens_per_sec': config.train.batch_size * config.train.seq_len / step_seconds_measured,
           'mfu': 0.1, 'peak_device_bytes': 11e9, 'estimate_gpu_bytes': {'total': 10e9}}
  workdir = tmp_path / device_kind.replace(' ', '_')
  workdir.mkdir()
  (workdir / 'bench.json').write_text(json.dumps(bench))
  return PointFiles(str(workdir), 'H100-80GB', config)


def test_the_cost_model_is_compared_with_a_step_measured_on_its_own_gpu(tmp_path):
  config = tiny_config(**{'precision': 'bf16_mixed', 'model.remat': 'full'})
  cfg, train = model_config(config), config.train
  seconds = step_seconds(cfg, Recipe('bf16_mixed', 32, 0, 1, 'full', 1), train.batch_size,
                         train.seq_len, Target(1, 'H100-80GB', **GPUS['H100-80GB']),
                         get_policy('bf16_mixed'))
  measured = 3 * seconds['total']
  on_h100 = _bench_point(tmp_path, 'NVIDIA H100 80GB HBM3', config, measured)
  assert METRICS['modelled_vs_measured'].read(on_h100) == pytest.approx(1 / 3)
  # One GPU: the optimizer is the only part the compute's MFU does not scale.
  expected = MFU_ASSUMED * seconds['compute'] / (measured - seconds['optimizer'])
  assert METRICS['calibrated_mfu'].read(on_h100) == pytest.approx(expected)
  assert METRICS['peak_vs_estimate'].read(on_h100) == pytest.approx(1.1)
  flops = cfg.flops_per_token(train.seq_len) * train.batch_size * train.seq_len / measured
  assert METRICS['mfu_peak'].read(on_h100) == pytest.approx(flops / GPUS['H100-80GB']['peak_bf16'])
  causal = cfg.flops_per_token(train.seq_len, causal=True) * train.batch_size * train.seq_len / measured
  assert METRICS['mfu_peak_causal'].read(on_h100) == pytest.approx(
      causal / GPUS['H100-80GB']['peak_bf16'])
  assert METRICS['mfu_peak_causal'].read(on_h100) < METRICS['mfu_peak'].read(on_h100)
  # Against the fp8 peak only where the point's matmuls are fp8 and the GPU has that peak.
  assert METRICS['mfu_peak_fp8'].read(on_h100) is None
  fp8 = tiny_config(**{'precision': 'bf16_mixed', 'model.remat': 'full', 'quant.mode': 'fp8'})
  (tmp_path / 'fp8').mkdir()
  on_h100_fp8 = _bench_point(tmp_path / 'fp8', 'NVIDIA H100 80GB HBM3', fp8, measured)
  assert METRICS['mfu_peak_fp8'].read(on_h100_fp8) == pytest.approx(
      METRICS['mfu_peak'].read(on_h100_fp8) * 989 / 1979)
  on_a100_fp8 = _bench_point(tmp_path / 'fp8', 'NVIDIA A100-SXM4-80GB', fp8, measured)
  assert METRICS['mfu_peak_fp8'].read(on_a100_fp8) is None   # no fp8 tensor cores
  on_cpu = _bench_point(tmp_path, 'cpu', config, measured)
  for metric in ('modelled_vs_measured', 'calibrated_mfu', 'mfu_peak', 'mfu_peak_causal',
                 'mfu_peak_fp8'):
    assert METRICS[metric].read(on_cpu) is None


def test_the_results_are_named_after_the_device():
  assert gpu_report.device_slug('NVIDIA H100 80GB HBM3') == 'nvidia-h100-80gb-hbm3'
  assert gpu_report.device_slug('cpu') == 'cpu'


def test_a_gpu_run_reports_its_goals_calibration_and_claim():
  rows = {'1b_bf16_mixed': {**_row(100.0, 0.48, 1.02), 'calibrated_mfu': 0.40},
          '1b_bf16_mixed_xla': {**_row(130.0, 0.37, 1.05), 'calibrated_mfu': 0.30},
          '1b_fp8': {**_row(70.0, 0.69, 0.97), 'calibrated_mfu': 0.60},
          '7b_lora': {**_row(900.0, 0.3, 1.01), 'calibrated_mfu': 0.20}}
  planner = gpu_report.planner_summary(rows)
  assert planner['calibrated_mfu_median'] == pytest.approx(0.35)   # fp8 and LoRA left out
  device = {'platform': 'gpu', 'device_kind': 'NVIDIA H100 80GB HBM3', 'count': 1,
            'bytes_limit': 79.6e9, 'jax': '0.11.2'}
  claim = {'config': 'configs/qlora.py:20b', 'batch_size': 4, 'seq_len': 1024,
           'target': '1xRTX4090-24GB', 'card_bytes': 24e9, 'log': 'claim/log.txt',
           'memory_fraction': '0.3015', 'status': 'done',
           'plan': {'recipe': 'bf16_mixed, remat full', 'compiled_bytes': 20.4e9,
                    'estimate_bytes': 20.8e9, 'step_seconds': 7.64},
           'bench': {'steps': 3, 'step_seconds': 2.5, 'tokens_per_sec': 1638.4, 'loss': 10.5,
                     'peak_device_bytes': 18.9e9, 'estimate_gpu_bytes': {'total': 17.6e9},
                     'device_bytes_limit': 24e9}}
  results = {'command': 'python -m bench.gpu', 'date': '2026-11-24', 'smoke': False,
             'device': device, 'cases': [{'case': k, **v} for k, v in rows.items()],
             'goals': gpu_report.goals(rows, 'gpu'), 'planner': planner, 'claim': claim}
  text = gpu_report.markdown(results)
  assert '| 48.0% | FAIL |' in text and '| 1.429 | pass |' in text   # 100 / 70 >= 1.3
  assert 'would need to match the cases without quantized matmuls or a frozen base here: 35.0%' in text
  assert ('the allocator limited to the card\'s 24 GB (memory fraction 0.3015: 24.00 GB as the '
          'device reports it)') in text
  assert 'peak 18.90 GB of 24 GB: it fits (GPU estimate 17.60 GB, peak ÷ estimate 1.074;' in text
  out_of_memory = {**claim, 'status': 'failed', 'bench': None,
                   'error': 'RESOURCE_EXHAUSTED: Out of memory allocating 1.2GiB'}
  text = gpu_report.markdown({**results, 'claim': out_of_memory})
  assert 'failed with the allocator limited to the card\'s 24 GB' in text
  assert 'RESOURCE_EXHAUSTED: Out of memory allocating 1.2GiB (log: claim/log.txt)' in text


def test_the_claims_card_is_a_fraction_of_the_device_rounded_down():
  h100 = {'device_kind': 'NVIDIA H100 80GB HBM3', 'bytes_limit': 84.9e9}
  env, fraction = gpu_memory.card_environment({'PATH': '/bin'}, h100, 24e9)
  assert env['XLA_PYTHON_CLIENT_MEM_FRACTION'] == fraction == '0.282685'   # 0.2826855... down
  assert float(fraction) * h100['bytes_limit'] <= 24e9 and env['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'true'
  assert env['PATH'] == '/bin'
  # An environment that uses the newer variable gets it, and never both (jaxlib refuses the pair).
  env, _ = gpu_memory.card_environment({'XLA_CLIENT_MEM_FRACTION': '0.9'}, h100, 24e9)
  assert env['XLA_CLIENT_MEM_FRACTION'] == '0.282685' and 'XLA_PYTHON_CLIENT_MEM_FRACTION' not in env
  assert gpu_memory.with_fraction({'XLA_PYTHON_CLIENT_MEM_FRACTION': '0.5'}, '0.95', keep=True)[
      'XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.5'
  with pytest.raises(ValueError, match=r'card \(141.0 GB\) is larger than the NVIDIA H100'):
    gpu_memory.card_environment({}, h100, 141e9)
  with pytest.raises(ValueError, match='reports no memory limit'):
    gpu_memory.card_environment({}, {'device_kind': 'NVIDIA H100 80GB HBM3'}, 24e9)
