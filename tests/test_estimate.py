"""memory/estimate.py: the analytic per-device total agrees with XLA's compiled one within 10 %
across layouts, precisions, remat policies, 8-bit Adam, microbatches, attention implementations
and the chunked loss, on the installed jax's XLA:CPU (8 simulated CPU devices,
the `tiny` preset so that each compile takes seconds); `python -m bench.studies.memory_matrix`
runs the larger matrix."""
import dataclasses

import jax
import pytest

from bench.studies.memory_matrix import compare
from memory.estimate import StepShape, estimate, saved_per_token_per_layer
from models.config import ModelConfig
from precision.policy import get_policy
from tests.helpers import child_environ

TOLERANCE = 0.10
# Known, measured, to be fixed under issue 30: on jaxlib 0.11 and 0.12 (bf16 matmuls native on the
# CPU) the 2-D dense products' backward (quant/contraction.py) and 64-position flash blocks moved
# these two compiled totals (zero2: -15.4 %, fsdp flash: +11.7 % on jax 0.12.0.1; both within 10 %
# on the pinned 0.10.2, where bf16 matmuls run in fp32). Strict: fixed, they must be unmarked.
_NATIVE_BF16_DRIFT = pytest.mark.xfail(
    tuple(int(p) for p in jax.__version__.split('.')[:2]) >= (0, 11), strict=True,
    reason='issue 30: the estimate is not yet calibrated for native bf16 CPU matmuls with the '
           '2-D dense backward and small flash blocks')

CASES = [
    ('ddp', {'precision': 'fp32'}),
    ('zero1', {'precision': 'fp32', 'quant.adam_bits': 8}),
    ('zero2', {'precision': 'bf16_master'}),   # 2 + 2 + 12 bytes, the master in the optimizer
    pytest.param('zero2', {'precision': 'bf16_mixed', 'train.microbatches': 2,
                           'train.batch_size': 16}, marks=_NATIVE_BF16_DRIFT),
    ('fsdp', {'precision': 'bf16_mixed'}),
    ('tp', {'precision': 'bf16', 'model.num_kv_heads': 4}),   # tp splits kv heads 4 ways
    ('fsdp_tp', {'precision': 'fp32', 'model.remat': 'full'}),
    ('ddp', {'precision': 'bf16_mixed', 'model.remat': 'dots'}),
    # Longer than a flash block (two blocks of 512), with the loss in chunks, and the same length
    # with the written-out attention.
    pytest.param('fsdp', {'precision': 'bf16_mixed', 'model.remat': 'full', 'train.seq_len': 1024,
                          'model.max_seq_len': 1024, 'model.attention': 'flash',
                          'model.loss_chunk': 256}, marks=_NATIVE_BF16_DRIFT),
    ('fsdp', {'precision': 'fp32', 'train.seq_len': 1024, 'model.max_seq_len': 1024,
              'model.attention': 'xla'}),
    # Host memory: the offloaded optimizer state and activations (on XLA:CPU the step writes what
    # it sends to host memory into device temp, as the CPU estimate counts it; the LoRA base:
    # tests/test_offload.py).
    ('zero2', {'precision': 'bf16_master', 'parallel.offload_optimizer': True}),
    ('fsdp', {'precision': 'bf16_mixed', 'parallel.offload_optimizer': True,
              'model.remat': 'offload'}),
    # Pipelines: 4 stages x 2-way fsdp, GPipe and circular (bench/studies/pipeline.py runs larger
    # ones).
    ('pipeline', {'precision': 'fp32', 'model.num_layers': 8}),
    ('pipeline', {'precision': 'bf16_mixed', 'model.num_layers': 8, 'model.remat': 'full',
                  'parallel.pipeline_schedule': 'circular', 'parallel.pipeline_repeats': 2}),
]


def _case_id(layout: str, overrides: dict) -> str:
  return '-'.join([layout] + [f'{k.split(".")[-1]}={v}' for k, v in overrides.items()])


@pytest.mark.parametrize('layout,overrides', CASES, ids=[_case_id(*getattr(case, 'values', case)) for case in CASES])
def test_estimate_is_within_ten_percent_of_the_compiled_total(layout, overrides):
  row = compare(layout, 'tiny', 8, overrides)
  assert abs(row['error']) <= TOLERANCE, (
      f'{row["config"]}: estimate {row["estimate"]:,} vs compiled {row["compiled"]:,} bytes '
      f'({100 * row["error"]:+.1f} %); parts {row["memory"]["estimate_bytes"]}')


CFG = ModelConfig(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, mlp_dim=192, max_seq_len=64)


def test_total_is_the_sum_of_the_parts():
  parts = estimate(CFG, get_policy('bf16_mixed'), StepShape(rows_per_device=2, seq_len=64))
  assert {'params', 'grads', 'optimizer', 'activations', 'temporaries'} <= set(parts)
  assert parts['total'] == sum(v for k, v in parts.items() if k != 'total')


def test_zero_stages_shard_the_state_in_order():
  def state(stage):
    parts = estimate(CFG, get_policy('fp32'),
                     StepShape(rows_per_device=2, seq_len=64, fsdp=8, zero_stage=stage))
    return parts['params'], parts['grads'], parts['optimizer']
  ddp, zero1, zero2, zero3 = (state(stage) for stage in range(4))
  assert zero1[2] == ddp[2] / 8 and zero1[:2] == ddp[:2]
  assert zero2[1] == ddp[1] / 8 and zero2[0] == ddp[0]
  assert zero3 == tuple(x / 8 for x in ddp)


def test_only_16_bit_compute_pays_for_the_cpu_fp32_copies():
  """In fp32 the CPU and GPU estimates differ only where the GPU's program does: its SwiGLU keeps
  three of the six [mlp_dim] values autodiff's keeps per token per layer (models/swiglu.py), and
  its two RMSNorms their inputs and a number per row, not two [d_model] values more each
  (models/rmsnorm.py)."""
  shape = StepShape(rows_per_device=2, seq_len=64)
  gpu = dataclasses.replace(shape, backend='gpu')
  fp32 = get_policy('fp32')
  on_cpu, on_gpu = estimate(CFG, fp32, shape), estimate(CFG, fp32, gpu)
  per_layer = {platform: saved_per_token_per_layer(CFG, fp32, 64, backend=platform)
               for platform in ('cpu', 'gpu')}
  assert per_layer['cpu'].pop('mlp') - per_layer['gpu'].pop('mlp') == 3 * CFG.mlp_dim * 4
  assert CFG.norm == 'rms'
  assert (per_layer['cpu'].pop('residual_and_norms') - per_layer['gpu'].pop('residual_and_norms')
          == 2 * CFG.d_model * 4 - 2 * 4)
  assert per_layer['cpu'] == per_layer['gpu']
  assert on_cpu['activations'] > on_gpu['activations']
  assert {k: v for k, v in on_cpu.items() if k not in ('activations', 'total')} == {
      k: v for k, v in on_gpu.items() if k not in ('activations', 'total')}


def test_the_cpu_estimate_follows_the_installed_compiler():
  """The CPU's fp32 copies of bf16 matmul operands are counted exactly when the installed XLA:CPU
  makes them (jax 0.10 does, 0.11 does not)."""
  import jax
  import jax.numpy as jnp
  from memory.estimate import cpu_upcasts_bf16
  a = jnp.ones((512, 512), jnp.bfloat16)
  hlo = jax.jit(lambda x: x @ x).lower(a).compile().as_text()
  assert cpu_upcasts_bf16() == ('f32[512,512]{1,0} dot(' in hlo)
  # A layer's saved input under remat full: fp32 where XLA:CPU upcasts, else the compute dtype.
  # (Comparing whole CPU and GPU estimates cannot tell: other terms differ between the two.)
  saved = saved_per_token_per_layer(CFG, get_policy('bf16_mixed'), 64, remat='full')
  assert saved == {'residual_and_norms': CFG.d_model * (4 if cpu_upcasts_bf16() else 2)}


@pytest.mark.parametrize('block', ['llama', 'gpt2'])
def test_8bit_moments_are_counted_from_the_models_own_tensors(block):
  """The optimizer term equals the bytes of the optimizer state the run creates, for the Llama
  block and GPT-2's (LayerNorm, GELU MLP, biases, learned positions): the estimate counts the
  model's parameter tree, not one architecture's formula. 8-bit moments pad each tensor to whole
  blocks, so a wrong tensor list shows."""
  import numpy as np
  from configs import default
  from tests.helpers import tiny_config
  from train import run
  config = tiny_config(**{'quant.adam_bits': 8, 'quant.adam_block_size': 256,
                          'model.mlp_dim': 200})
  if block == 'gpt2':
    for key, value in {'model.norm': 'layer', 'model.mlp': 'gelu', 'model.positions': 'learned',
                       'model.bias': True, 'model.rope_scaling': 'none'}.items():
      default.override(config, key, value)
  s = run.setup(config, devices=jax.devices()[:1])
  shape = StepShape(rows_per_device=config.train.batch_size, seq_len=config.train.seq_len,
                    adam_bits=8, adam_block_size=256)
  created = sum(int(np.prod(x.shape)) * x.dtype.itemsize
                for x in jax.tree.leaves(s.layout.abstract['opt_state']) if x.ndim)   # not counters
  assert estimate(s.model, s.policy, shape)['optimizer'] == created


@pytest.mark.parametrize('preset, layout, was', [
    ('100m', {'parallel.zero_stage': 2, 'mesh.tensor': 1}, '-15.9 %'),
    ('1b', {'parallel.zero_stage': 3, 'mesh.tensor': 4}, '+12.6 %'),
    # 768 does not divide 512: the state is stored padded (parallel/padding.py).
    ('100m', {'parallel.zero_stage': 1, 'host_devices': 512}, 'refused: 768 over 512'),
    ('100m', {'parallel.zero_stage': 3, 'host_devices': 512}, 'refused: 768 over 512'),
    pytest.param('1b', {'parallel.zero_stage': 3, 'mesh.tensor': 1}, '-10.8 % mid-issue',
                 marks=pytest.mark.xfail(
                     tuple(int(p) for p in jax.__version__.split('.')[:2]) == (0, 11), strict=True,
                     reason='issue 30: the CPU terms are jax 0.10.2\'s; on jax 0.11.2 this '
                            'compiles 9.6 % above the estimate (within 1 % on 0.10.2 and 0.12.0.1)')),
])
def test_the_formerly_worst_layouts_meet_the_compiler(tmp_path, preset, layout, was):
  """Issue 30's worst rows at sizes that compile in seconds (sweeps/estimate.py runs them all):
  bf16 with fp32 weights, full remat, a sequence per device, 64 simulated devices (512 where the
  row is about padding; a child process: this one has 8); within 5 % of the installed jax's
  compiled total (`was`: before)."""
  layout = dict(layout)
  devices = layout.pop('host_devices', 64)
  memory = _dry_run(tmp_path, f'configs/default.py:{preset}', devices, child_environ(), {
      'precision': 'bf16_mixed', 'model.remat': 'full', 'train.batch_size': devices,
      'train.microbatches': 1, 'mesh.data': 1, 'mesh.fsdp': -1, **layout})
  compiled, estimate_ = memory['per_device_bytes']['total'], memory['estimate_bytes']['total']
  assert abs(estimate_ / compiled - 1) <= 0.05, (estimate_, compiled, was)


def _dry_run(tmp_path, config: str, devices: int, env: dict, overrides: dict) -> dict:
  """memory.json of `main.py --dry_run` in a child process with `env` (its own device count)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  done = subprocess.run(
      [sys.executable, os.path.join(root, 'main.py'), f'--config={config}', '--dry_run',
       f'--host_devices={devices}', f'--workdir={tmp_path}',
       *(f'--config.{k}={v}' for k, v in {**overrides, 'compile_cache': ''}.items())],
      cwd=root, env=env, capture_output=True, text=True)
  assert done.returncode == 0, done.stderr[-2000:]
  with open(tmp_path / 'memory.json') as f:
    return json.load(f)


def test_zero2s_roomy_update_order_is_counted_only_where_the_device_has_room():
  """ZeRO-2 on XLA:GPU: the sets that every stack's Adam step leaves waiting before the layer
  loops (memory/estimate.py:roomy_update_sets) are counted on a device with room for them or of
  unknown size, and not where the total with them would exceed the device's memory (XLA:GPU then
  orders the update one stack at a time: WORKSPACE, 2026-12-02, fourth session)."""
  from configs import default
  from memory.estimate import roomy_update_sets
  cfg = ModelConfig.from_config(default.get_config('7b').model.to_dict())
  policy = get_policy('bf16_mixed')
  shape = StepShape(rows_per_device=1, seq_len=4096, fsdp=8, zero_stage=2, backend='gpu')
  sets = roomy_update_sets(cfg, policy, shape)
  assert sets == 2 * cfg.num_params * 4 / 8
  unknown, roomy = (estimate(cfg, policy, dataclasses.replace(shape, device_memory=m))
                    for m in (0, 1e15))
  assert unknown == roomy
  tight = estimate(cfg, policy, dataclasses.replace(shape, device_memory=roomy['total'] - 1))
  assert tight['total'] < roomy['total'] and tight['update'] < roomy['update']
  # A device exactly as large as the total with the sets holds them.
  assert estimate(cfg, policy, dataclasses.replace(shape, device_memory=roomy['total'])) == roomy
  for other in (dict(zero_stage=3), dict(fsdp=1), dict(stages=2)):   # not ZeRO-2's update, or not read
    assert roomy_update_sets(cfg, policy, dataclasses.replace(shape, **other)) == 0
  assert roomy_update_sets(cfg, get_policy('bf16_master'), shape) == 0


def test_zero1s_padded_update_holds_the_d_model_last_stacks_twice_on_gpus():
  """ZeRO-1 on XLA:GPU where fsdp does not divide d_model (100m, 768, on 512 devices): the
  buffers read at the update's peak (memory/estimate.py:padded_zero1_copies): a second copy of the
  down and output projections' stacks, two padded f32[3072, 1024] gathers of one layer's down
  projection and one f32[768, 3072]. They are among the new weights that ZeRO-1's update forms
  (`gathered_new_weights`), and absent where fsdp divides d_model, under ZeRO-2 (whose padded new
  weights are `padded_new_weights`), on XLA:CPU and where they were not read."""
  from configs import default
  from memory.estimate import gathered_new_weights, padded_zero1_copies
  cfg = ModelConfig.from_config(default.get_config('100m').model.to_dict())
  policy = get_policy('bf16_mixed')
  shape = StepShape(rows_per_device=1, seq_len=512, fsdp=512, zero_stage=1, backend='gpu')
  copies = padded_zero1_copies(cfg, policy, shape)
  stacks = 12 * (3072 * 768 + 12 * 64 * 768) * 4
  assert copies == stacks + (2 * 3072 * 1024 + 768 * 3072) * 4
  on_cpu = dataclasses.replace(shape, backend='cpu')
  assert (gathered_new_weights(cfg, policy, shape)
          == gathered_new_weights(cfg, policy, on_cpu) + copies)
  for other in (dict(fsdp=64), dict(zero_stage=2), dict(backend='cpu'), dict(adam_bits=8),
                dict(stages=2)):
    assert padded_zero1_copies(cfg, policy, dataclasses.replace(shape, **other)) == 0


def test_gradients_not_formed_at_the_peak_are_a_part_of_their_own():
  """On one GPU the head's backward peaks before any gradient exists: the estimate takes them off
  as `unformed_grads`, a negative part the summary prints with a minus, so that every other part
  stays what its name says (no negative temporaries)."""
  from memory.compiled import format_bytes
  from memory.estimate import format_parts
  cfg = dataclasses.replace(CFG, vocab_size=32000)   # a head large enough to be the peak
  parts = estimate(cfg, get_policy('bf16_mixed'),
                   StepShape(rows_per_device=4, seq_len=256, backend='gpu'))
  assert parts['unformed_grads'] == -parts['grads']
  assert min(v for k, v in parts.items() if k != 'unformed_grads') >= 0
  text = format_parts(parts)
  assert f' - unformed_grads {format_bytes(parts["grads"])}' in text
  assert '+ unformed_grads' not in text and 'total' not in text


@pytest.mark.skipif(jax.__version_info__[:2] != (0, 10), reason=(
    "the XLA:CPU terms are jax 0.10.2's: 0.11.2 compiles this step to 33.50 GiB and 0.12.0.1 to "
    "27.46, without the chunk loop's copies"))
def test_1f1b_under_remat_meets_the_compiler_at_7b(tmp_path):
  """Issue 50: 7b, 32 layers on 4 stages x 2-way ZeRO-3, 32 microbatches of one 4096-token row a
  device, remat full, 1F1B: within 5 % of XLA:CPU's compiled total (-8.1 % before the chunk
  loop's second weight copy was counted; bench/results/pipeline_7b_vocab_stage.json). Compiled
  as a user compiles it (a child without the suite's quick compile, whose program at this point
  holds 4 GiB less)."""
  import os
  memory = _dry_run(tmp_path, 'configs/pipeline.py:7b', 8, {**os.environ, 'XLA_FLAGS': ''}, {
      'model.num_layers': 32, 'train.batch_size': 64, 'train.microbatches': 1, 'mesh.stage': 4,
      'mesh.fsdp': -1, 'parallel.pipeline_microbatches': 32, 'parallel.pipeline_schedule': '1f1b'})
  compiled, estimate_ = memory['per_device_bytes']['total'], memory['estimate_bytes']['total']
  assert abs(estimate_ / compiled - 1) <= 0.05, (compiled, memory['estimate_bytes'])
