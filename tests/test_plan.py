"""The planner: targets parsed or refused in one line, nothing-fits said with by how much, and the
recipe it returns compiles within the target's memory."""
import dataclasses
import importlib.util
import os

import pytest

from configs import default
from plan.cost import Recipe
from plan.search import MARGIN, PlanError, evaluate, plan, recipes
from plan.target import TargetError, parse_target
from plan.report import compile_total, run_plan, verifier


def test_targets_are_parsed():
  t = parse_target('8xA100-80GB')
  assert (t.count, t.memory, t.per_node) == (8, 80e9, 8)
  assert parse_target('2x0.5GB').memory == 0.5e9


@pytest.mark.parametrize('text, message', [
    ('8xA100', "unknown GPU 'A100' in --target='8xA100'; known: A100-40GB, A100-80GB"),
    ('eightxH100-80GB', 'is not <N>x<GPU>'),
    ('0xH100-80GB', 'is not <N>x<GPU>'),
])
def test_bad_targets_are_refused_naming_what_is_allowed(text, message):
  with pytest.raises(TargetError, match=message):
    parse_target(text)


def test_a_model_too_large_for_any_recipe_says_by_how_much():
  config = default.get_config('70b')
  with pytest.raises(PlanError, match=r'nothing fits 1xRTX4090-24GB: the smallest recipe .* needs '
                                      r'an estimated [\d.]+ GB per device, [\d.]+x the 21.6 GB usable'):
    plan(config, parse_target('1xRTX4090-24GB'), compile_total=None)


def test_recipes_respect_the_mesh_and_the_batch():
  config = default.get_config('7b')      # batch 32, 32 heads
  found = recipes(config, parse_target('8xH100-80GB'))
  assert found and all(8 % (r.tensor * r.context) == 0
                       and 32 % (8 // (r.tensor * r.context) * r.microbatches) == 0 for r in found)
  assert not any(r.adam_bits == 8 and r.tensor > 1 for r in found)
  # Context shards within the node, each holding two chunks of at least one GPU flash block.
  assert {r.context for r in found} == {1, 2, 4}   # 4096 tokens: chunks of 2048, 1024, 512


def test_long_sequences_are_split_over_context_shards():
  """7b at 128k tokens on one node: the fastest recipe that fits by the estimate splits the
  sequence, and none fits that splits neither the sequence nor (tensor parallelism) the layers'
  activations; the context comm is priced where it is, and nowhere else."""
  config = default.get_config('7b')
  config.train.seq_len = config.model.max_seq_len = 131072
  config.train.batch_size = 8
  target = parse_target('8xH100-80GB')
  candidates = [evaluate(config, r, target) for r in recipes(config, target)]
  budget = target.memory * (1 - MARGIN)
  fitting = [c for c in candidates if c.device_bytes <= budget]
  assert fitting and min(fitting, key=lambda c: c.seconds['total']).recipe.context > 1
  assert all(c.recipe.context > 1 or c.recipe.tensor > 1 for c in fitting)
  assert any(c.recipe.context == 1 for c in candidates)
  assert all((c.seconds['context_comm'] > 0) == (c.recipe.context > 1) for c in candidates)
  # A ring moves the keys and values under the compute; a gather waits for them.
  gather = next(c for c in fitting if c.recipe.context_attention == 'gather')
  ring = evaluate(config, dataclasses.replace(gather.recipe, context_attention='ring'), target)
  assert ring.seconds['total'] < gather.seconds['total']
  # and holds no more (less where a layer's backward is the step's peak: on a GPU here the head's is)
  assert ring.estimate['total'] <= gather.estimate['total']


def test_pipeline_stages_are_offered_across_nodes_and_priced_by_their_bubble():
  config = default.get_config('70b')     # 80 layers, batch 256
  one_node, eight_nodes = parse_target('8xH100-80GB'), parse_target('64xH100-80GB')
  assert all(r.stages == 1 for r in recipes(config, one_node))
  staged = [r for r in recipes(config, eight_nodes) if r.stages > 1]
  assert {r.stages for r in staged} == {2, 4, 8}          # divisors of 80 layers, one node or more each
  assert all(r.pipeline_microbatches >= r.stages for r in staged)
  assert not any(r.stages > 1 for r in recipes(config, eight_nodes, stages=False))
  # The same recipe with and without stages: compute stretched by (M + P - 1) / M.
  piped = next(r for r in staged if r.stages == 4 and r.pipeline_microbatches == 16)
  flat = dataclasses.replace(piped, stages=1, pipeline_microbatches=1)
  seconds = lambda r: evaluate(config, r, eight_nodes).seconds
  assert seconds(piped)['compute'] == pytest.approx(seconds(flat)['compute'] * (16 + 3) / 16)
  assert seconds(piped)['pipeline_comm'] > 0 == seconds(flat)['pipeline_comm']
  # Zero bubble: 3M + P - 1 ticks of F, B or W for 3M (a third of the bubble), two activations
  # sent at every tick.
  assert {(r.schedule, r.repeats) for r in staged} == {
      ('gpipe', 1), ('1f1b', 1), ('zb_h1', 1), ('circular', 2), ('interleaved_1f1b', 2)}
  zero_bubble = dataclasses.replace(piped, schedule='zb_h1')
  assert seconds(zero_bubble)['compute'] == pytest.approx(
      seconds(flat)['compute'] * (48 + 3) / 48)
  assert seconds(zero_bubble)['pipeline_comm'] == pytest.approx(
      seconds(piped)['pipeline_comm'] * (48 + 3) / (16 + 3))
  # Full remat recomputes a forward pass (a third of a step's work); ZB-H1's B and W each call a
  # layer's pullback, so each replays it.
  remat = lambda r: seconds(dataclasses.replace(r, remat='full'))['compute'] / seconds(r)['compute']
  assert remat(flat) == pytest.approx(4 / 3) and remat(zero_bubble) == pytest.approx(5 / 3)
  # Two chunks a stage: M R + P - 1 iterations for M R, so half the bubble of 1F1B, which
  # recomputes as interleaved 1F1B does; an activation sent at every iteration, and the weights
  # and their gradients re-laid out over the stages once a step.
  one_f_one_b = dataclasses.replace(piped, schedule='1f1b')
  interleaved = dataclasses.replace(piped, schedule='interleaved_1f1b', repeats=2)
  assert seconds(interleaved)['compute'] / seconds(one_f_one_b)['compute'] == pytest.approx(
      (32 + 3) / 32 / ((16 + 3) / 16))
  # The 1F1B schedules' loop runs R P + M R + P - 2 ticks, each sending both ways.
  assert seconds(one_f_one_b)['pipeline_bytes'] == pytest.approx(
      seconds(piped)['pipeline_bytes'] * (4 + 16 + 4 - 2) / (16 + 3))
  # Circular with one chunk a stage is GPipe's program: nothing recomputed.
  assert seconds(dataclasses.replace(piped, schedule='circular'))['compute'] == pytest.approx(
      seconds(piped)['compute'])
  circular = dataclasses.replace(piped, schedule='circular', repeats=2)
  assert seconds(circular)['compute'] == pytest.approx(seconds(interleaved)['compute'])
  assert seconds(circular)['pipeline_bytes'] > seconds(piped)['pipeline_bytes'] * (32 + 3) / (16 + 3)
  assert not any(r.schedule == 'interleaved_1f1b' and r.pipeline_microbatches % r.stages
                 for r in staged)


def test_the_chosen_recipe_compiles_within_the_target(tmp_path, monkeypatch):
  """A small model on a target so small that most recipes do not fit: what comes back fits as the
  plan's own check compiled it (a `main.py --dry_run` of each candidate's config file), and the
  config file it writes loads to the very config that check compiled. (Compiling the written file
  again would be the same XLA:GPU compile, 15 s, a second time.)"""
  from plan import report
  compiled = []

  def recorded(config, target, backend):
    total = compile_total(config, target, backend)
    compiled.append((config.to_dict(), total))
    return total
  monkeypatch.setattr(report, 'compile_total', recorded)
  config = default.get_config('small')   # 12 of 252 recipes fit (100m on 2x1.2GB: 3x longer)
  config.train.batch_size = 8
  config.train.seq_len = 256
  target = parse_target('2x0.05GB')
  path = run_plan(config, target, str(tmp_path / 'w'), 'test')
  spec = importlib.util.spec_from_file_location('planned', path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  planned = module.get_config()
  assert (planned.name, planned.host_devices) == (f'planned:{config.name}@2x0.05GB', 0)
  written = {**planned.to_dict(), 'name': config.name, 'host_devices': config.host_devices}
  totals = [total for candidate, total in compiled if candidate == written]
  assert totals, f'the written config is none of the {len(compiled)} the plan compiled'
  assert isinstance(totals[-1], int) and totals[-1] <= target.memory * (1 - MARGIN)
  assert planned.mesh.to_dict()['data'] * planned.mesh.fsdp * planned.mesh.tensor == 2
  assert os.path.basename(path) == 'planned_config.py'


def test_a_workdir_with_a_plan_is_refused_before_anything_compiles(tmp_path, monkeypatch):
  """The user's planned_config.py is never overwritten, and the refusal comes first, not after
  the verifying compiles (minutes at 405b)."""
  saved = tmp_path / 'planned_config.py'
  saved.write_text('# a plan the user kept\n')
  from plan import report
  monkeypatch.setattr(report, 'compile_total', lambda *a: pytest.fail('compiled'))
  with pytest.raises(FileExistsError, match='planned_config.py already exists'):
    run_plan(default.get_config('small'), parse_target('2x0.05GB'), str(tmp_path), 'test')
  assert saved.read_text() == '# a plan the user kept\n'


@pytest.mark.parametrize('args, message', [
    (['--target=8xA100'], "unknown GPU 'A100'"),
    (['--target=16xH100-80GB', '--config=configs/fsdp.py:70b', '--config.train.batch_size=3',
      '--noplan_stages'], 'no recipe can split batch 3 over 16xH100-80GB'),
    (['--config=configs/fsdp.py:70b', '--target=1xRTX4090-24GB'], 'nothing fits 1xRTX4090-24GB'),
])
def test_main_reports_plan_errors_in_one_line(tmp_path, args, message):
  from tests.test_run import main_py
  result = main_py('--plan', f'--workdir={tmp_path / "w"}', *args)
  assert result.returncode != 0 and 'Traceback' not in result.stderr
  assert message in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / 'w').exists()


def test_a_qlora_config_is_sized_with_only_its_adapters_training():
  from configs import finetune
  from plan.search import evaluate
  target = parse_target('1xRTX4090-24GB')
  full, qlora = default.get_config('7b'), finetune.finetune_config('qlora', '7b')
  for config in (full, qlora):
    config.train.batch_size, config.train.microbatches = 4, 4
  recipe = next(r for r in recipes(qlora, target) if r.precision == 'bf16' and r.remat == 'full'
                and r.microbatches == 4)
  full_bytes = evaluate(full, recipe, target).estimate
  qlora_bytes = evaluate(qlora, recipe, target).estimate
  assert qlora_bytes['optimizer'] < 1e-3 * full_bytes['optimizer']
  # 7B in NF4 is about 3.5 GB against 13.5 GB of bf16 weights
  assert 0.2 < qlora_bytes['params'] / full_bytes['params'] < 0.3
  assert all(r.adam_bits == 32 for r in recipes(qlora, target))   # 8-bit moments of adapters: no


def test_the_plan_keeps_an_fp32_master_unless_pure_bf16_is_allowed():
  """Quality is in the objective: pure bf16 (updates rounded to bf16) is never picked unless
  allowed; where nothing else fits the plan says so and names the flag, and where it would have
  been faster the plan says what keeping the master cost."""
  from plan.search import keeps_fp32_update, tradeoff
  from configs.hardware import GB
  config = default.get_config('1b')
  config.train.batch_size, config.train.seq_len = 8, 512
  # A GPU on which only pure bf16 fits by the installed version's estimate: halfway between the
  # smallest recipe without an fp32 master and the smallest with one. The sizes themselves depend
  # on the XLA:CPU the plan verifies with (jax 0.10 holds bf16 activations in fp32, 0.11 on does
  # not: memory/estimate.py), so no fixed size is such a GPU on every version; the order is.
  one = parse_target('1x80GB')
  on_one = [evaluate(config, r, one) for r in recipes(config, one)]
  kept = min(c.estimate['total'] for c in on_one if keeps_fp32_update(c))
  pure = min(c.estimate['total'] for c in on_one if not keeps_fp32_update(c))
  assert pure < kept
  tight = parse_target(f'1x{(pure + kept) / 2 / (1 - MARGIN) / GB:.3f}GB')

  def never(_):
    raise AssertionError('a plan that refuses compiles nothing')

  with pytest.raises(PlanError, match=r'only recipes without an fp32 master fit .*'
                                      r'--plan_allow_pure_bf16'):
    plan(config, tight, compile_total=never)
  compiled = []
  chosen, _ = plan(config, tight, compile_total=lambda c: compiled.append(c.precision) or 0,
                   allow_pure_bf16=True, log=lambda line: None)
  assert not keeps_fp32_update(chosen) and compiled == [chosen.recipe.precision]
  target = parse_target('8xH100-80GB')
  budget = target.memory * (1 - MARGIN)
  candidates = [evaluate(config, r, target) for r in recipes(config, target)]
  assert {c.recipe.precision for c in candidates} == {'bf16_master', 'bf16_mixed', 'bf16'}
  kept = [c for c in candidates if keeps_fp32_update(c) and c.estimate['total'] <= budget]
  chosen = min(kept, key=lambda c: c.seconds['total'])
  assert chosen.recipe.precision in ('bf16_master', 'bf16_mixed')
  note = tradeoff(chosen, candidates, budget)
  assert note and 'kept an fp32 master' in note and '--plan_allow_pure_bf16' in note
  pure = min((c for c in candidates if not keeps_fp32_update(c)), key=lambda c: c.seconds['total'])
  assert 'updates bf16 weights directly' in tradeoff(pure, candidates, budget)


def test_a_compile_without_a_memory_total_is_never_taken_as_fitting():
  """A compile that reports no per-device total (None) or fails (a reason) is not verified: the
  plan goes on to the next recipe, and where none is verified says so in one line."""
  config = default.get_config('100m')
  config.train.batch_size, config.train.seq_len = 8, 256
  target = parse_target('2x80GB')
  with pytest.raises(PlanError, match=r'none of the 6 fastest recipes .* could be verified: .*'
                                      r'no per-device memory total'):
    plan(config, target, compile_total=lambda c: None, log=lambda line: None)
  answers = iter([None, 'did not compile (F1 ...)', 1])
  chosen, ranked = plan(config, target, compile_total=lambda c: next(answers),
                        log=lambda line: None)
  assert chosen is ranked[2] and chosen.compiled == 1
  assert all(isinstance(c.compiled, str) for c in ranked[:2])
  answers = iter(['did not compile (F1 ...)'] + [80e9] * 5)
  with pytest.raises(PlanError, match=r'5 compile above the 72.0 GB usable, 1 could not be '
                                      r'verified; the estimate is too optimistic'):
    plan(config, target, compile_total=lambda c: next(answers), log=lambda line: None)


def test_a_frozen_base_is_costed_without_weight_gradients():
  """LoRA's step runs the forward pass and the gradient of each matmul's input, not of its weight:
  4 FLOPs per weight instead of 6; full remat adds one forward pass (2 per weight) either way."""
  from configs import finetune
  from train.checks import model_config
  target = parse_target('1xH100-80GB')
  full, lora = default.get_config('7b'), finetune.finetune_config('lora', '7b')
  cfg, seq = model_config(full), full.train.seq_len
  n, attention = cfg.matmul_params, cfg.flops_per_token(seq) - 6 * cfg.matmul_params
  assert cfg.flops_per_token(seq, base_trains=False) == 4 * n + attention
  for remat, recomputed in (('none', 0), ('full', 2 * n + attention / 3)):
    recipe = Recipe('bf16_mixed', 32, 0, 1, remat, 1)
    ratio = (evaluate(lora, recipe, target).seconds['compute']
             / evaluate(full, recipe, target).seconds['compute'])
    assert ratio == pytest.approx((4 * n + attention + recomputed) / (6 * n + attention + recomputed),
                                  rel=1e-12)


def test_the_optimizer_traffic_reads_the_moments_in_their_stored_dtype():
  """The update reads and writes the weight, its gradient and both moments (and the master where
  the policy keeps one): pure bf16 stores its moments in bf16, half the bytes of 32-bit Adam's
  fp32 moments, and 8-bit Adam a byte per value plus an fp32 scale per block of 2048."""
  from plan.cost import step_seconds
  from precision.policy import get_policy
  from train.checks import model_config
  config, target = default.get_config('1b'), parse_target('1xH100-80GB')
  cfg, seq = model_config(config), config.train.seq_len

  def optimizer_bytes(precision, adam_bits):
    seconds = step_seconds(cfg, Recipe(precision, adam_bits, 0, 1, 'none', 1), 8, seq, target,
                           get_policy(precision))
    return seconds['optimizer'] * target.hbm / cfg.num_params

  assert optimizer_bytes('bf16', 32) == pytest.approx(3 * 2 + 2 * 2 * 2, rel=1e-9)
  assert optimizer_bytes('bf16_mixed', 32) == pytest.approx(3 * 4 + 2 * 2 * 4, rel=1e-9)
  assert optimizer_bytes('bf16_master', 32) == pytest.approx(3 * 2 + 2 * 4 + 2 * 2 * 4, rel=1e-9)
  # The 8-bit codes' blocks are padded to whole blocks, so allow the padding of the few tensors
  # (norm scales, 2048 values or fewer, stay 32-bit: a few parts in 10^4 of the model).
  assert optimizer_bytes('bf16_mixed', 8) == pytest.approx(3 * 4 + 2 * 2 * (1 + 4 / 2048), rel=1e-3)


def test_replicated_gradients_are_all_reduced_every_microbatch_where_the_step_cannot_sum_them():
  """DDP and ZeRO-1 sum their microbatches' gradients per device and all-reduce once, except where
  cuDNN's attention runs on packed rows (train/checks.py:unbatchable_attention): then the planner
  charges an all-reduce per microbatch, as the step does; ZeRO-2 is charged the same either way."""
  from plan.cost import step_seconds
  from plan.search import evaluate
  from precision.policy import get_policy
  from train.checks import model_config
  config, target = default.get_config('1b'), parse_target('16xH100-80GB')
  cfg, seq, policy = model_config(config), config.train.seq_len, get_policy('bf16_mixed')

  def reduced(stage, **flag):
    recipe = Recipe('bf16_mixed', 32, stage, 1, 'full', 4)
    return step_seconds(cfg, recipe, 64, seq, target, policy, **flag)['data_parallel_bytes']

  for stage in (0, 1):
    assert reduced(stage, reduces_every_microbatch=True) == pytest.approx(4 * reduced(stage))
  assert reduced(2, reduces_every_microbatch=True) == reduced(2)
  ddp = Recipe('bf16_mixed', 32, 0, 1, 'full', 4)
  packed = evaluate(config, ddp, target).seconds['data_parallel_bytes']
  config.data.packing = False
  assert packed == pytest.approx(4 * evaluate(config, ddp, target).seconds['data_parallel_bytes'])


def _fastest_fitting(preset: str, target_name: str, **overrides):
  from plan.search import host_fits
  config = default.get_config(preset)
  for key, value in overrides.items():
    default.override(config, key, value)
  target = parse_target(target_name)
  fitting = [c for c in (evaluate(config, r, target) for r in recipes(config, target))
             if c.device_bytes <= target.memory * (1 - MARGIN) and host_fits(c, target)
             and (c.recipe.precision, c.recipe.adam_bits) == ('bf16_master', 32)]
  return min(fitting, key=lambda c: c.seconds['total']) if fitting else None, target


def test_the_optimizer_state_goes_to_host_memory_only_where_nothing_else_fits():
  one_sequence = {'train.batch_size': 1, 'train.seq_len': 2048, 'train.microbatches': 1}
  # 7B full fine-tuning (bf16 weights, fp32 master, 32-bit Adam) does not fit one 80 GB GPU
  # unless its optimizer state is offloaded; its trip over PCIe is charged in the step time.
  chosen, target = _fastest_fitting('7b', '1xH100-80GB', **one_sequence)
  assert chosen is not None and chosen.recipe.offload
  state = chosen.host['optimizer']
  assert chosen.seconds['host_transfer'] == pytest.approx(2 * state / target.host_link, rel=0.05)
  assert chosen.host['total'] <= target.host_memory
  # On 8 of them it fits without, and faster.
  chosen, _ = _fastest_fitting('7b', '8xH100-80GB', **{**one_sequence, 'train.batch_size': 8})
  assert chosen is not None and not chosen.recipe.offload
  # A node's host memory is part of the fit: with 100 GB of it the state (81 GB, held twice
  # during the update) does not fit, so nothing does.
  from plan.search import host_fits
  offloaded, target = _fastest_fitting('7b', '1xH100-80GB', **one_sequence)
  small_host = dataclasses.replace(target, host_memory=100e9)
  assert host_fits(offloaded, target) and not host_fits(offloaded, small_host)


@pytest.mark.parametrize('recipe', [
    Recipe('bf16_mixed', 32, 0, 1, 'dots', 1), Recipe('bf16_mixed', 32, 1, 1, 'none', 1),
    Recipe('bf16_mixed', 32, 3, 2, 'full', 2), Recipe('bf16_mixed', 32, 3, 1, 'full', 1, context=2)])
def test_the_planner_estimates_a_recipe_as_the_dry_run_of_its_config_does(recipe):
  """The planner builds its step shape from the recipe (plan/search.py:evaluate), the dry run
  from the mesh (train/run.py:step_shape); at 1b with its logits at the peak (8 x 2048 tokens a
  device) they must agree on every term, the gradients summed over devices included."""
  import jax
  from plan.search import apply
  from train import run
  config = default.get_config('1b')
  config.train.batch_size, config.train.seq_len = 64, 2048
  planned = evaluate(config, recipe, parse_target('8xH100-80GB'))
  s = run.setup(apply(config, recipe, 8), jax.devices('cpu')[:8])
  assert run.estimated_bytes(s, backend='gpu')[0] == planned.estimate
