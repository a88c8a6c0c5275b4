"""Weight-only post-training quantization: storage really shrinks, logits stay close, and a quantized
model saved and restored gives exactly the logits of quantizing in memory."""
import jax
import numpy as np
import pytest
from flax import nnx

from configs import default
from models.dense import Dense, quantize_weights, stored_bytes
from quant.llm_int8 import recording_outliers
from quant.weights import QuantizedKernel, QuantizedWeight
from tests.helpers import random_tokens, tiny_config, tiny_model
from tests.test_run import small_corpus
from train import checks, ptq, run
from train.checkpoint import CheckpointError
from train.validation import make_eval_loop

# bytes per dense weight: codes plus scales (int8: one fp32 scale per output channel; int4: one per
# 64 inputs, packed two per byte; nf4: 64-value blocks with 8-bit double-quantized scales)
# (the tiny model's tensors are small, so the per-tensor overheads weigh more than at scale)
BYTES_PER_WEIGHT = {'int8': (1.0, 1.07), 'int4': (0.5, 0.57), 'nf4': (0.5, 0.55)}


@pytest.fixture(scope='module')
def trained(tmp_path_factory):
  workdir = tmp_path_factory.mktemp('run') / 'w'
  corpus = small_corpus(tmp_path_factory.mktemp('c'))
  config = tiny_config(**{'train.steps': 6, 'data.path': corpus})
  run.train_and_evaluate(config, str(workdir))
  config = ptq.run_config(str(workdir), default.get_config('tiny'))
  return config, ptq.restore_params(str(workdir), config)


@pytest.mark.parametrize('fmt', sorted(BYTES_PER_WEIGHT))
def test_quantized_kernels_are_frozen_and_take_the_promised_bytes(fmt):
  _, model = tiny_model()
  kernels = sum(m.kernel[...].size for _, m in nnx.iter_modules(model) if isinstance(m, Dense))
  quantize_weights(model, fmt)
  denses = [m for _, m in nnx.iter_modules(model) if isinstance(m, Dense)]
  assert denses and all(isinstance(m.kernel, QuantizedKernel) for m in denses)
  # No kernel is a parameter any more: nothing to differentiate or give optimizer state.
  assert all('kernel' not in str(path) for path, _ in nnx.to_flat_state(nnx.state(model, nnx.Param)))
  low, high = BYTES_PER_WEIGHT[fmt]
  assert low * kernels < stored_bytes(model)['quantized'] <= high * kernels


@pytest.mark.parametrize('fmt, tolerance', [('int8', 0.02), ('int4', 0.25), ('nf4', 0.2)])
def test_quantized_logits_stay_close_to_the_float_model(fmt, tolerance):
  _, model = tiny_model()
  tokens = random_tokens((2, 16))
  reference = np.asarray(model(tokens))
  got = np.asarray(quantize_weights(model, fmt)(tokens))
  assert np.abs(got - reference).max() < tolerance * np.abs(reference).max()
  assert not np.array_equal(got, reference)


@pytest.mark.parametrize('fmt', sorted(BYTES_PER_WEIGHT))
def test_a_saved_quantized_model_restores_with_identical_logits(trained, fmt, tmp_path):
  config, params = trained
  in_memory = ptq.build_quantized(config, checks.policy(config), params, fmt)
  ptq.save_quantized(in_memory, config, fmt, str(tmp_path / 'q'))
  restored, restored_config, restored_fmt = ptq.restore_quantized(str(tmp_path / 'q'))
  assert restored_fmt == fmt and restored_config.model.to_dict() == config.model.to_dict()
  tokens = random_tokens((2, 16))
  np.testing.assert_array_equal(np.asarray(restored(tokens)), np.asarray(in_memory(tokens)))
  assert all(isinstance(v, QuantizedWeight) for _, v in nnx.to_flat_state(
      nnx.state(restored, QuantizedWeight)))


def test_saving_never_overwrites(trained, tmp_path):
  config, params = trained
  model = ptq.build_quantized(config, checks.policy(config), params, 'int8')
  target = tmp_path / 'exists'
  target.mkdir()
  (target / 'keep.txt').write_text('mine')
  with pytest.raises(CheckpointError, match='already exists'):
    ptq.save_quantized(model, config, 'int8', str(target))
  assert (target / 'keep.txt').read_text() == 'mine'


def test_compiled_arguments_shrink_with_the_stored_format(trained):
  config, params = trained
  batch = {'inputs': random_tokens((1, 2, 16)), 'targets': random_tokens((1, 2, 16), seed=1)}

  def argument_and_stored_bytes(fmt):
    model = ptq.build_quantized(config, checks.policy(config), params, fmt)
    graphdef, state = nnx.split(model)
    compiled = jax.jit(make_eval_loop(graphdef)).lower(state, {}, batch).compile()
    return compiled.memory_analysis().argument_size_in_bytes, sum(stored_bytes(model).values())

  fp32_args, fp32_stored = argument_and_stored_bytes(None)
  for fmt in ('int8', 'int4', 'nf4'):
    args, stored = argument_and_stored_bytes(fmt)
    assert fp32_args - args == fp32_stored - stored > 0.5 * fp32_stored   # every byte saved is real


def test_llm_int8_reports_its_outlier_columns():
  config = tiny_config(**{'quant.mode': 'llm_int8', 'quant.threshold': 1.0})
  _, model = tiny_model()
  from train.state import build_model
  model = build_model(checks.model_config(config), checks.policy(config), 0)
  with recording_outliers() as records:
    jax.block_until_ready(jax.jit(lambda m, t: m(t))(model, random_tokens((2, 16))))
  # 2 layers x (q, k, v, out, gate, up, down) products; RMS-normed inputs exceed 1.0 somewhere.
  assert len(records) == 2 * 7
  assert all(0 <= n <= k for n, k in records) and sum(n for n, _ in records) > 0


def test_a_run_without_checkpoints_is_refused(tmp_path):
  with pytest.raises(CheckpointError, match='does not exist'):
    ptq.run_config(str(tmp_path), default.get_config('tiny'))


def test_a_run_without_checkpoints_is_refused_and_left_as_it_was(tmp_path):
  (tmp_path / 'config.json').write_text('{}')
  config = ptq.run_config(str(tmp_path), default.get_config('tiny'))
  with pytest.raises(CheckpointError, match='checkpoints does not exist; train first'):
    ptq.restore_params(str(tmp_path), config)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['config.json']


def test_an_lsq_model_exports_and_quantizes_on_its_learned_grid():
  """After training moved the step sizes, the exported float weights (train/export_hf.py) and the
  int4 storage of post-training quantization both give the run's own quantized logits: the
  kernels on the learned grid, not the raw kernels nor an absmax grid. What remains is the fp32
  rounding of the step (LSQ's gradient-scaling identity, s f + (s - s f)): a few ulps."""
  from train.export_hf import merged_params
  config = tiny_config(**{'quant.mode': 'int4', 'quant.learned_scale': True,
                          'train.learning_rate': 1e-2})
  s = run.setup(config, jax.devices()[:1])
  state = s.layout.init()
  tokens = random_tokens((4, 33))
  for i in range(3):
    with s.context():
      state, _ = s.train_step(state, {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]})
  params = state['params']
  moved = np.abs(np.asarray(params['blocks']['mlp']['down']['step_size']) -
                 np.asarray(s.layout.init()['params']['blocks']['mlp']['down']['step_size']))
  assert moved.max() > 0
  run_model = nnx.merge(s.layout.graphdef, params)
  expected = np.asarray(run_model(tokens[:, :-1]))

  float_config = tiny_config()
  float_model = run.setup(float_config, jax.devices()[:1]).spec.build()
  nnx.update(float_model, nnx.State(merged_params(config, params, {})))
  exported = np.asarray(float_model(tokens[:, :-1]))
  np.testing.assert_allclose(exported, expected, rtol=1e-5, atol=1e-5)

  quantized = ptq.build_quantized(config, checks.policy(config), params, 'int4')
  np.testing.assert_allclose(np.asarray(quantized(tokens[:, :-1])), expected, rtol=1e-5, atol=1e-5)
  # the raw kernels (what an export that dropped the step sizes gave) are measurably elsewhere
  raw = run.setup(float_config, jax.devices()[:1]).spec.build()
  from flax import traverse_util
  nnx.update(raw, nnx.State(traverse_util.unflatten_dict({
      k: np.asarray(v) for k, v in traverse_util.flatten_dict(params).items()
      if k[-1] != 'step_size'})))
  assert np.abs(np.asarray(raw(tokens[:, :-1])) - expected).max() > 1e-3
