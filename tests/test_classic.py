"""bench/classic_memory.py: the classic memory figures come out of the analytic model, and this project's
recipes come in under them by the factors their bytes per parameter say."""
import pytest

from bench import classic_memory as classic

ROWS = classic.training_rows()


def _row(model, recipe):
  return next(r for r in ROWS if r.model == model and r.recipe == recipe)


@pytest.mark.parametrize('model,params', [('1B', 1e9), ('175B', 175e9), ('500B', 500e9)])
def test_model_shapes_have_the_named_parameter_counts(model, params):
  assert classic.MODELS[model].num_params == pytest.approx(params, rel=0.02)


def test_storing_1b_takes_4_2_1_and_half_a_gb():
  stored = classic.storage_bytes(classic.MODELS['1B'])
  for fmt, want in classic.CLASSIC_STORAGE.items():
    assert stored[fmt] == pytest.approx(want, rel=0.02), fmt


@pytest.mark.parametrize('model', list(classic.MODELS))
def test_training_in_fp32_with_adam_matches_the_classic_figure(model):
  row = _row(model, 'classic: fp32 + Adam')
  assert row.total == pytest.approx(classic.CLASSIC_TRAINING[model], rel=0.10)
  assert row.state_bytes_per_param == pytest.approx(16, rel=1e-6)   # 4 + 4 + 8, from estimate()


@pytest.mark.parametrize('model', list(classic.MODELS))
def test_recipes_cut_state_by_their_bytes_per_param(model):
  n = classic.DEVICES[model]
  expected = {'bf16 mixed': 1, 'bf16 + 8-bit Adam': 6 / 16, 'bf16 mixed + ZeRO-3': 1 / n,
              'bf16 + 8-bit Adam + ZeRO-3': 6 / 16 / n}
  for recipe, factor in expected.items():
    # 8-bit moments carry an fp32 scale per 2048 values and fp32 norm-scale moments: above 6/16.
    assert _row(model, recipe).state_vs_classic == pytest.approx(factor, rel=0.01), recipe


@pytest.mark.parametrize('model', list(classic.MODELS))
def test_every_recipe_needs_less_per_device_than_the_classic_figure(model):
  classic_total = _row(model, 'classic: fp32 + Adam').total
  for recipe in classic.RECIPES[1:]:
    assert _row(model, recipe.name).total < classic_total, recipe.name
  assert _row(model, 'bf16 + 8-bit Adam + ZeRO-3').total < 80e9


def test_the_classic_activation_rule_is_of_the_order_of_one_sequence_at_1b():
  assert 0.1 < classic.classic_activation_sequences('1B') < 4


def test_bench_prints_units_and_writes_a_png(tmp_path):
  from bench.studies import classic as bench
  table = bench.markdown()
  assert 'GB = 1e9 bytes' in table and 'total per device (GB)' in table
  assert table.count('| classic: fp32 + Adam |') == len(classic.MODELS)
  path = tmp_path / 'classic.png'
  bench.write_png(str(path))
  assert path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
