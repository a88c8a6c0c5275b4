"""bench/peak_buffers.py reads what a compiled step holds at its peak; with it, ZeRO-2's update is seen
to write its new weights a layer at a time instead of gathering whole stacks beside them."""
from configs import default
from configs.layouts import layout_config
from bench.peak_buffers import compile_with_dumps, phase_of, read_peak, read_phases
from train import run

# Parameters dominate: wide layers, a short batch (the layout tests' stage_bytes shape).
WIDE = {'model.d_model': 256, 'model.mlp_dim': 1024, 'model.num_heads': 8, 'model.num_kv_heads': 4,
        'model.head_dim': 32, 'model.num_layers': 8, 'train.batch_size': 8, 'train.seq_len': 16,
        'compile_cache': ''}


def compiled_peak(layout: str, tmp_path, **overrides):
  config = layout_config(layout, 'tiny')
  for key, value in {**WIDE, **overrides}.items():
    default.override(config, key, value)
  s = run.setup(config)
  lowered = run.lower_train_step(s)
  with s.context():
    compiled = compile_with_dumps(lowered, str(tmp_path))
  return s, run.memory_report(s, compiled), read_peak(str(tmp_path))


def test_the_peak_is_read_from_the_temp_allocation(tmp_path):
  _, report, peak = compiled_peak('zero2', tmp_path)
  temp = report['per_device_bytes']['temp']
  assert peak.temp_bytes == temp
  # The live values' byte ranges at one point cannot exceed the allocation they sit in; XLA sizes
  # it to its largest such occupancy (plus any gaps between values), so most of it is found.
  assert temp / 2 <= peak.peak_bytes <= temp
  assert peak.live and peak.at
  assert sum(b.size for b in peak.live) >= peak.peak_bytes


def test_each_phase_of_the_step_is_read_at_its_own_peak(tmp_path):
  """bench.buffers --phases: the forward and backward layer scans, the head and the update each at
  the largest occupancy while one of their instructions runs; the step's peak is the largest."""
  _, _, peak = compiled_peak('fsdp', tmp_path, **{'model.remat': 'full'})
  phases = read_phases(str(tmp_path))
  assert {'layers forward', 'layers backward', 'head backward', 'update'} <= set(phases)
  assert max(p.peak_bytes for p in phases.values()) == peak.peak_bytes
  assert list(phases) == sorted(phases, key=lambda name: -phases[name].peak_bytes)
  for name, at in phases.items():
    assert phase_of(at.at_op_name) == name, (name, at.at, at.at_op_name)
    assert 0 < at.peak_bytes <= at.temp_bytes
  # The backward scan holds the saved residual stack and the layer's recomputed values at once;
  # the forward scan is still filling that stack.
  assert phases['layers backward'].peak_bytes > phases['layers forward'].peak_bytes


def test_zero2_gathers_new_weights_one_layer_at_a_time(tmp_path):
  s, report, peak = compiled_peak('zero2', tmp_path)
  assert s.layout.layer_writes   # the stacked weights, stored whole and updated in shards
  # A whole stacked MLP kernel (8 layers x 256 x 1024 in fp32, 8 MiB): gathered at once, new
  # values of that size would sit in temp beside the weights; one layer's are an eighth of it.
  whole_stack = 8 * 256 * 1024 * 4
  assert max(b.size for b in peak.live) < whole_stack, peak.live[:3]


def test_the_estimate_meets_zero2_at_100m_on_8_devices():
  """Formerly 12 % under the compiler (the whole-stack gathers above, 70b: 18 %): the estimate
  within its +-5 % at 100m, bf16 with fp32 weights, full remat (the sweep's shape)."""
  config = layout_config('zero2', '100m')
  for key, value in {'precision': 'bf16_mixed', 'model.remat': 'full', 'train.batch_size': 8,
                     'train.microbatches': 1, 'compile_cache': ''}.items():
    default.override(config, key, value)
  s = run.setup(config)
  report = run.memory_report(s, run.compile_train_step(s))
  compiled, estimate = report['per_device_bytes']['total'], report['estimate_bytes']['total']
  assert abs(estimate / compiled - 1) <= 0.05, (estimate, compiled)
