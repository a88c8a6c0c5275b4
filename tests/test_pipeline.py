"""Pipeline parallelism (parallel/pipeline.py): the schedule's table and moves, the same losses and
parameters as one device for gpipe and circular with fsdp or tensor parallelism inside the stages,
checkpoints that move between pipelined and plain meshes, and bad settings refused in one line."""
import functools
import re

import jax
import numpy as np
import pytest

from configs import default
from configs.layouts import layout_config
from parallel import pipeline_1f1b, pipeline_zb
from parallel.pipeline import PipelineSchedule
from parallel.stage_layers import LayerSplit
from tests.helpers import random_tokens, reordered_rtol
from train import checks, run
from train.checkpoint import Checkpointer

# Wide enough for 2-way fsdp and tensor splits, deep enough for 4 stages x 2 chunks.
SHAPE = {'model.d_model': 64, 'model.num_heads': 4, 'model.num_kv_heads': 4, 'model.mlp_dim': 128,
         'model.num_layers': 8, 'train.seq_len': 16}


def config(batch_size: int, **overrides):
  c = layout_config('pipeline', 'tiny')
  for key, value in {**SHAPE, 'train.batch_size': batch_size, **overrides}.items():
    default.override(c, key, value)
  return c


def single_device(batch_size: int):
  return config(batch_size, **{'mesh': dict(stage=1, data=1, fsdp=1, tensor=1),
                               'parallel.zero_stage': 0})


def train(c, devices=None, steps: int = 3, packed: bool = False):
  """(losses, final parameters as numpy, the setup) of `steps` steps from the seed's state.
  `packed`: each row holds documents of random lengths (segments), their first targets not
  predicted."""
  s = run.setup(c, devices)
  state, losses = s.layout.init(), []
  for i in range(steps):
    tokens = random_tokens((c.train.batch_size, c.train.seq_len + 1), seed=i)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
    if packed:
      starts = np.random.default_rng(i).random(batch['inputs'].shape) < 0.15
      segments = 1 + np.cumsum(starts, axis=1).astype(np.int32)
      targets = np.where(np.concatenate([segments[:, 1:] != segments[:, :-1],
                                         np.zeros_like(starts[:, :1])], axis=1), -1, batch['targets'])
      batch = {**batch, 'targets': targets, 'segments': segments}
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    losses.append(float(metrics['loss']))
  return losses, jax.tree.map(np.asarray, jax.device_get(state['params'])), s


# ---- the schedule ----------------------------------------------------------------------------
@pytest.mark.parametrize('stages,microbatches,repeats', [(4, 4, 1), (4, 8, 1), (2, 3, 1),
                                                         (4, 4, 2), (4, 6, 3), (8, 8, 2)])
def test_every_item_visits_every_stage_once_in_order_and_the_bubble_is_the_formula(
    stages, microbatches, repeats):
  schedule = PipelineSchedule('circular' if repeats > 1 else 'gpipe', stages, microbatches, repeats)
  table = schedule.table()
  assert table.shape == (microbatches * repeats + stages - 1, stages)
  for p in range(stages):
    worked = table[:, p][table[:, p] >= 0]
    np.testing.assert_array_equal(worked, np.arange(microbatches * repeats))   # each once, in order
  assert schedule.bubble_fraction == pytest.approx(
      (stages - 1) / (microbatches * repeats + stages - 1))


@pytest.mark.parametrize('stages,microbatches,repeats', [(4, 4, 1), (2, 5, 1), (4, 4, 2),
                                                         (3, 5, 3), (8, 8, 2)])
def test_the_moves_give_each_stage_the_activation_of_its_item(stages, microbatches, repeats):
  """Runs the ring with labels instead of activations: a stage's work turns (microbatch, chunk c)
  into (microbatch, c + 1), and every stage must hold the label of the item the table says."""
  schedule = PipelineSchedule('circular' if repeats > 1 else 'gpipe', stages, microbatches, repeats)
  M, P = microbatches, stages
  moves, table = schedule.moves(), schedule.table()
  ring = [[(m, 0) for m in range(M)] + [None] * (M + 1) for _ in range(P)]
  held = [None] * P
  for t in range(schedule.iterations):
    for p in range(P):
      ring[p][moves['write'][t, p]] = held[p]
      held[p] = ring[p][moves['read'][t, p]]
      item = table[t, p]
      if item >= 0:
        m, r = item % M, item // M
        assert held[p] == (m, r * P + p), (t, p)            # chunk r * P + p is next for it
        assert (moves['chunk'][t, p], moves['microbatch'][t, p]) == (r, m)
        held[p] = (m, r * P + p + 1)
    held = held[-1:] + held[:-1]                            # every activation one stage on
  ring[0][schedule.final_slot] = held[0]
  assert ring[0][M:2 * M] == [(m, P * repeats) for m in range(M)]   # through every chunk


@pytest.mark.parametrize('stages,microbatches,repeats', [(4, 16, 1), (4, 4, 1), (2, 3, 1), (4, 5, 1),
                                                         (4, 8, 2), (2, 6, 3), (8, 8, 2)])
def test_1f1b_ticks_give_each_slot_its_input_and_keep_a_bounded_number(stages, microbatches, repeats):
  """Runs the 1f1b loop with labels: a forward turns (microbatch, c) into (microbatch, c + 1), a
  backward turns the gradient label of c + 1 into that of c from the kept input (microbatch, c);
  every slot must get the label the schedule says, no kept input may be overwritten before its
  backward, and every microbatch must come out of the embedding's gradient once."""
  P, M, R = stages, microbatches, repeats
  schedule = PipelineSchedule('1f1b' if R == 1 else 'interleaved_1f1b', P, M, R)
  t = schedule.ticks()
  kept = [[None] * schedule.in_flight for _ in range(P)]
  forward_in, backward_in, embedded = [None] * P, [None] * P, []
  for tick in range(schedule.iterations):
    outs, grads = [None] * P, [None] * P
    for p in range(P):
      loss_grad = None
      if t['f_valid'][tick, p]:
        m, c = t['f_micro'][tick, p], t['f_chunk'][tick, p] * P + p
        held = (m, 0) if t['f_first'][tick, p] else forward_in[p]
        assert held == (m, c), (tick, p)
        assert kept[p][t['f_slot'][tick, p]] is None   # the slot's last input went backward
        kept[p][t['f_slot'][tick, p]] = held
        outs[p] = (m, c + 1)
        if t['f_last'][tick, p]:
          assert c + 1 == P * R
          loss_grad = ('grad', m, P * R)
      if t['b_valid'][tick, p]:
        m, c = t['b_micro'][tick, p], t['b_chunk'][tick, p] * P + p
        incoming = loss_grad if t['b_first'][tick, p] else backward_in[p]
        assert incoming == ('grad', m, c + 1), (tick, p)
        assert kept[p][t['b_slot'][tick, p]] == (m, c)
        kept[p][t['b_slot'][tick, p]] = None
        grads[p] = ('grad', m, c)
        if t['b_last'][tick, p]:
          embedded.append(m)
    forward_in, backward_in = outs[-1:] + outs[:-1], grads[1:] + grads[:1]
  assert sorted(embedded) == list(range(M))
  assert t['f_valid'].sum() == t['b_valid'].sum() == P * M * R
  assert schedule.in_flight <= 2 * R * P - 1   # whatever M
  assert schedule.bubble_fraction == pytest.approx((P - 1) / (M * R + P - 1))


@pytest.mark.parametrize('stages,microbatches,repeats', [(4, 4, 1), (2, 3, 1), (4, 8, 2), (2, 6, 3),
                                                         (8, 8, 2)])
def test_every_index_the_loops_read_with_is_in_range(stages, microbatches, repeats):
  """The loops read their slots, chunks and microbatches by a dynamic slice (`pipeline.at`), which
  clamps an index out of range where `a[index]` would wrap it: every table must hold each index
  within its array, for gpipe or circular, 1f1b or interleaved, and ZB-H1."""
  P, M, R = stages, microbatches, repeats
  def within(table, keys, size):
    for key in keys:
      assert 0 <= np.min(table[key]) and np.max(table[key]) < size, (key, size)
  moves = PipelineSchedule('gpipe' if R == 1 else 'circular', P, M, R).moves()
  within(moves, ['read', 'write'], 2 * M + 1)   # the ring: M microbatches and M + 1 slots
  within(moves, ['chunk'], R)
  within(moves, ['microbatch'], M)
  schedule = PipelineSchedule('1f1b' if R == 1 else 'interleaved_1f1b', P, M, R)
  ticks = schedule.ticks()
  within(ticks, ['f_slot', 'b_slot'], schedule.in_flight)
  within(ticks, ['f_chunk', 'b_chunk'], R)
  within(ticks, ['f_micro', 'b_micro'], M)
  if R == 1:
    tables = PipelineSchedule('zb_h1', P, M, 1).zero_bubble
    keys = ['micro', 'forward_micro', 'backward_micro']
    within({k: getattr(tables, k) for k in keys}, keys, M)


# ---- against one device ----------------------------------------------------------------------
@pytest.fixture(scope='module')
def reference():
  """Single-device losses and parameters."""
  return train(single_device(BATCH), devices=jax.devices()[:1])[:2]


PIPELINES = {   # name: overrides of the layout (4 stages x 2-way fsdp, ZeRO-3, gpipe, M = 4)
    'gpipe-fsdp-M4': {},
    'circular-fsdp-M8': {'parallel.pipeline_schedule': 'circular', 'parallel.pipeline_repeats': 2,
                         'parallel.pipeline_microbatches': 8},
    'gpipe-tensor-M8': {'mesh': dict(stage=2, data=2, fsdp=1, tensor=2), 'parallel.zero_stage': 0,
                        'parallel.pipeline_microbatches': 8},
    # Uneven chunks (parallel.pipeline_stage_layers): each taken out of the stored stack, the
    # shorter ones passing their input through their spare slots.
    'circular-tensor-M4-layers-1331': {'mesh': dict(stage=2, data=1, fsdp=2, tensor=2),
                                       'parallel.zero_stage': 1,
                                       'parallel.pipeline_schedule': 'circular',
                                       'parallel.pipeline_repeats': 2, 'train.microbatches': 2,
                                       'parallel.pipeline_stage_layers': '1,3,3,1'},
    # ZeRO-3's weights gathered once per step, before the loop (parallel.pipeline_gather_once).
    'gpipe-fsdp-M4-gather-once-layers-1331': {'parallel.pipeline_gather_once': True,
                                              'parallel.pipeline_stage_layers': '1,3,3,1'},
    'circular-fsdp-M8-gather-once': {'parallel.pipeline_schedule': 'circular',
                                     'parallel.pipeline_repeats': 2,
                                     'parallel.pipeline_microbatches': 8,
                                     'parallel.pipeline_gather_once': True},
    '1f1b-fsdp-M8-layers-3122': {'parallel.pipeline_schedule': '1f1b',
                                 'parallel.pipeline_microbatches': 8,
                                 'parallel.pipeline_stage_layers': '3,1,2,2'},
    'interleaved_1f1b-fsdp-M8': {'parallel.pipeline_schedule': 'interleaved_1f1b',
                                 'parallel.pipeline_repeats': 2, 'parallel.pipeline_microbatches': 8},
    # Replicated gradients summed per data-parallel device (train/step.py's per_device); under
    # remat the chunk's layers run in a loop, without it unrolled.
    '1f1b-tensor-data-M4-remat': {'mesh': dict(stage=2, data=2, fsdp=1, tensor=2),
                                  'parallel.zero_stage': 0, 'parallel.pipeline_schedule': '1f1b',
                                  'model.remat': 'full'},
    'interleaved_1f1b-tensor-M4-layers-3113': {'mesh': dict(stage=2, data=1, fsdp=2, tensor=2),
                                               'parallel.zero_stage': 1, 'train.microbatches': 2,
                                               'parallel.pipeline_schedule': 'interleaved_1f1b',
                                               'parallel.pipeline_repeats': 2,
                                               'parallel.pipeline_stage_layers': '3,1,1,3'},
    # Zero bubble: real branches per stage (a shard_map over `stage`), the pullbacks' residuals
    # kept from F to W; under remat the residuals are the layers' inputs.
    'zb_h1-fsdp-M8': {'parallel.pipeline_schedule': 'zb_h1', 'parallel.pipeline_microbatches': 8},
    'zb_h1-tensor-data-M4-remat-layers-35': {'mesh': dict(stage=2, data=2, fsdp=1, tensor=2),
                                             'parallel.zero_stage': 0,
                                             'parallel.pipeline_schedule': 'zb_h1',
                                             'model.remat': 'full',
                                             'parallel.pipeline_stage_layers': '3,5'},
}
BATCH = 16


@pytest.mark.parametrize('name', list(PIPELINES))
def test_losses_and_parameters_equal_the_single_device_run(name, reference):
  losses, params, s = train(config(BATCH, **PIPELINES[name]))
  assert s.mesh.size == 8 and s.pipeline is not None
  want_losses, want_params = reference
  # The same terms summed in another order (per microbatch, per device, across devices).
  tokens = BATCH * s.config.train.seq_len
  np.testing.assert_allclose(losses, want_losses, rtol=reordered_rtol(tokens))
  # Adam divides every gradient by its own running RMS, so a weight whose gradients nearly cancel
  # over the steps amplifies the summation-order noise of its gradient sum: such weights (a few
  # in 10^5 here) may differ by a fraction of one step (lr); every other weight follows the same
  # trajectory to fp32 noise. A wrong pipeline (a layer out of order, a microbatch lost) moves
  # nearly every weight by the order of a step.
  lr = s.config.train.learning_rate
  diff = np.concatenate([np.abs(got - want).ravel() for got, want in
                         zip(jax.tree.leaves(params), jax.tree.leaves(want_params))])
  assert np.quantile(diff, 0.999) <= 1e-3 * lr
  assert diff.max() <= 0.1 * lr


def test_a_layer_count_no_stage_count_divides_trains_as_one_device():
  """7 layers on 4 stages: stored padded to 8 (2 a stage, the last one's second a layer of
  zeros), run as chunks of 2, 2, 2 and 1 layers by the schedule with real branches per stage. A
  vocabulary of 258 the same way: split over the 4 stages, stored as 260 rows, 2 of zeros."""
  uneven = {'model.num_layers': 7, 'model.vocab_size': 258}
  want_losses, want_params, _ = train(config(BATCH, **uneven, **{
      'mesh': dict(stage=1, data=1, fsdp=1, tensor=1), 'parallel.zero_stage': 0}),
      devices=jax.devices()[:1])
  losses, params, s = train(config(BATCH, **uneven, **{'parallel.pipeline_schedule': 'zb_h1',
                                                       'parallel.pipeline_microbatches': 8}))
  assert s.pipeline.layer_split(7).counts == (2, 2, 2, 1)
  np.testing.assert_allclose(losses, want_losses,
                             rtol=reordered_rtol(BATCH * s.config.train.seq_len))
  lr = s.config.train.learning_rate
  padded = {}
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    if got.shape != want.shape:   # the padding stays zero
      padded[got.shape[0]] = want.shape[0]
      assert not got[want.shape[0]:].any()
      got = got[:want.shape[0]]
    assert np.abs(got - want).max() <= 0.1 * lr
  assert padded == {8: 7, 260: 258}


@pytest.mark.parametrize('layers,stages,repeats,counts,want', [
    (16, 4, 1, (), (4, 4, 4, 4)),
    (15, 4, 1, (), (4, 4, 4, 3)),              # the storage's blocks: nothing moves
    (30, 4, 1, (), (8, 8, 8, 6)),
    (28, 8, 1, (), (3, 3, 4, 4, 4, 4, 3, 3)),  # blocks of 4 would leave the last stage none
    (12, 4, 2, (), (1, 1, 2, 2, 2, 2, 1, 1)),
    (16, 4, 1, (3, 5, 5, 3), (3, 5, 5, 3)),
    (12, 4, 1, (4, 4, 2, 2), (4, 4, 2, 2)),    # as deep as the blocks, but not them
])
def test_a_split_gives_every_layer_one_running_slot_in_model_order(layers, stages, repeats,
                                                                  counts, want):
  split = LayerSplit.of(layers, stages, repeats, counts)
  assert split.counts == want
  index, valid = split.slots()
  # Chunk r * stages + p on stage p runs its layers in order; together, every layer once.
  running = [index[c % stages, c // stages][valid[c % stages, c // stages]]
             for c in range(stages * repeats)]
  np.testing.assert_array_equal(np.concatenate(running), np.arange(layers))
  assert [len(r) for r in running] == list(want)
  stack = np.arange(layers * 3, dtype=np.float32).reshape(layers, 3)
  taken = np.asarray(split.take(stack))
  assert taken.shape == (stages, repeats, split.depth, 3)
  np.testing.assert_array_equal(taken[valid], stack[index[valid]])
  np.testing.assert_array_equal(np.asarray(split.put_back(taken)), stack)


@pytest.mark.parametrize('schedule', ['1f1b', 'zb_h1'])
def test_the_embedding_gradient_is_formed_once_where_that_keeps_less(schedule, monkeypatch):
  """8 rows of 16 tokens: their embedding outputs' gradients (32 KiB) are kept through the loop
  and the embedding's gradient formed once after it, rather than its 64 KiB table's gradient summed
  at every tick (the cases above, at 16 rows, sum it); equal to one device either way."""
  formed = []
  once = pipeline_1f1b.embedding_grads
  counted = lambda *a: formed.append(1) or once(*a)
  monkeypatch.setattr(pipeline_1f1b, 'embedding_grads', counted)
  monkeypatch.setattr(pipeline_zb, 'embedding_grads', counted)
  want_losses, want_params, _ = train(single_device(8), devices=jax.devices()[:1])
  losses, params, s = train(config(8, **{'parallel.pipeline_schedule': schedule,
                                         'parallel.pipeline_microbatches': 4}))
  assert formed
  np.testing.assert_allclose(losses, want_losses, rtol=reordered_rtol(8 * s.config.train.seq_len))
  lr = s.config.train.learning_rate
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    assert np.abs(got - want).max() <= 0.1 * lr


@pytest.mark.parametrize('schedule', ['1f1b', 'interleaved_1f1b', 'zb_h1'])
def test_lora_on_packed_rows_through_1f1b_equals_one_device(schedule):
  """The frozen base gets no gradient (the pipeline differentiates only what autodiff asks
  for), the adapters' match one device's, and packed documents stay apart across microbatches."""
  lora = {'lora.rank': 4, 'lora.alpha': 8.0, 'model.tie_embeddings': False}
  want_losses, want_params, _ = train(
      config(8, **lora, **{'mesh': dict(stage=1, data=1, fsdp=1, tensor=1),
                           'parallel.zero_stage': 0}), devices=jax.devices()[:1], packed=True)
  losses, params, s = train(config(8, **lora, **{
      'parallel.pipeline_schedule': schedule, 'parallel.pipeline_microbatches': 4,
      'parallel.pipeline_repeats': 2 if schedule == 'interleaved_1f1b' else 1}), packed=True)
  np.testing.assert_allclose(losses, want_losses, rtol=reordered_rtol(8 * s.config.train.seq_len))
  lr = s.config.train.learning_rate
  for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    assert np.abs(got - want).max() <= 0.1 * lr


@functools.lru_cache(maxsize=None)   # two tests read the same four programs' figures
def _compiled(schedule: str, microbatches: int, **overrides) -> dict:
  """memory.json's figures for the pipeline layout at `microbatches` microbatches of one row per
  device (4 stages x 2-way fsdp, ZeRO-3): the batch grows with them. Read, never changed."""
  c = config(2 * microbatches, **{'parallel.pipeline_schedule': schedule,
                                  'parallel.pipeline_microbatches': microbatches, **overrides})
  s = run.setup(c)
  return run.memory_report(s, run.compile_train_step(s))


def test_1f1b_keeps_its_temporary_memory_flat_in_the_microbatches_where_gpipe_grows():
  gpipe = [_compiled('gpipe', m)['per_device_bytes']['temp'] for m in (4, 16)]
  one_f_one_b = [_compiled('1f1b', m)['per_device_bytes']['temp'] for m in (4, 16)]
  assert gpipe[1] > 1.5 * gpipe[0]
  # The batch's tokens and targets (int32) grow with it; the activations do not.
  assert one_f_one_b[1] <= 1.1 * one_f_one_b[0]
  assert one_f_one_b[1] < gpipe[1] / 2


@pytest.mark.parametrize('schedule', ['gpipe', '1f1b', 'zb_h1'])
def test_a_split_other_than_the_blocks_moves_only_the_layers_it_runs_elsewhere(schedule):
  """6 layers on 4 stages are stored 2, 2, 2, 0 and run 1, 2, 2, 1: three layers move one stage
  on, and their gradients one stage back (collective permutes). Taken by a gather, XLA gathered
  the whole stack onto every stage and all-reduced its whole gradient (405b on 64 stages, ZB-H1
  on XLA:GPU: 207 GiB a device, 86 with the moves); so the step of 6 layers gathers and
  all-reduces no more than that of 8, split evenly."""
  even, uneven = (_compiled(schedule, 4, **{'model.num_layers': n})['collectives_per_step']
                  for n in (8, 6))
  for kind in ('all-gather', 'all-reduce'):
    assert uneven[kind]['bytes'] <= even[kind]['bytes'], kind


def test_zb_h1_under_remat_recomputes_a_chunk_a_layer_at_a_time_as_1f1b_does():
  """Under remat, B's and W's pullbacks recompute each layer's forward. Run as straight-line code,
  XLA recomputed the whole chunk's first and kept it (tiny, 4-layer chunks, a row a microbatch:
  1.6x 1F1B's temp; 7b on 4 stages at M 4: 129 against 54 GiB); in a loop over the chunk's
  layers, as 1F1B's backward slot runs, it keeps about what 1F1B keeps (1.0x here)."""
  deep = {'model.num_layers': 16, 'model.remat': 'full', 'train.seq_len': 64}
  temp = lambda schedule: _compiled(schedule, 4, **deep)['per_device_bytes']['temp']
  assert temp('zb_h1') <= 1.25 * temp('1f1b')


def test_zero3_under_1f1b_or_gathered_once_gathers_each_stages_weights_once_per_step():
  """1F1B gathers a stage's ZeRO-3 weights before its loop; GPipe at every iteration, unless
  parallel.pipeline_gather_once: then once, as 1F1B does."""
  def gathered(schedule, **overrides):
    reports = [_compiled(schedule, m, **overrides) for m in (4, 16)]
    assert all(r['pipeline']['gathered_once'] == (schedule == '1f1b' or bool(overrides))
               for r in reports)   # as memory.json says
    return [r['collectives_per_step']['all-gather']['bytes'] for r in reports]
  once, gpipe = gathered('1f1b'), gathered('gpipe')
  gpipe_once = gathered('gpipe', **{'parallel.pipeline_gather_once': True})
  assert once[0] == once[1] and gpipe_once[0] == gpipe_once[1]   # whatever the microbatches
  assert gpipe[1] > 2 * once[1] and gpipe[1] > 2 * gpipe_once[1]  # GPipe gathers at every iteration


@pytest.mark.parametrize('schedule, overrides', [
    ('1f1b', {}), ('gpipe', {'parallel.pipeline_gather_once': True})])
def test_weights_gathered_once_keep_their_tensor_split(schedule, overrides):
  """A stage's ZeRO-3 weights gathered once are whole over `fsdp` only: with 2-way tensor
  parallelism beside it, each device gathers its tensor half of them, not the whole weights
  (against the same mesh with a data axis in place of the tensor one). Two layers a stage: the
  split is each layer's, and 1F1B's program compiles in about two thirds of the time that four
  layers a stage take."""
  def gathered(mesh):
    s = run.setup(config(16, mesh=mesh, **{'parallel.pipeline_schedule': schedule,
                                           'model.num_layers': 4, **overrides}))
    return run.memory_report(s, run.compile_train_step(s))['collectives_per_step']['all-gather']['bytes']
  tensor = gathered(dict(stage=2, data=1, fsdp=2, tensor=2))
  data = gathered(dict(stage=2, data=2, fsdp=2, tensor=1))
  assert tensor < 0.75 * data, (tensor, data)


def test_the_dry_run_reports_the_compiled_schedule():
  s = run.setup(config(8))
  compiled = run.compile_train_step(s)
  memory = run.memory_report(s, compiled)
  pipe = memory['pipeline']
  assert pipe['bubble_fraction'] == pytest.approx(pipe['bubble_formula']) == pytest.approx(3 / 7)
  assert (pipe['stages'], pipe['microbatches'], pipe['iterations']) == (4, 4, 7)
  # Activations move between stages by collective-permute: at least one forward and one backward
  # per iteration of the loop, and the loop the compiler built runs the table's iterations.
  assert pipe['collective_permute'] == memory['collectives_per_step']['collective-permute']
  assert pipe['collective_permute']['count'] >= 2 * pipe['iterations']
  assert '"known_trip_count":{"n":"7"}' in compiled.as_text()


# ---- checkpoints -----------------------------------------------------------------------------
def test_a_pipelined_checkpoint_restores_onto_a_plain_mesh_and_back(tmp_path):
  """7 layers on 4 stages are stored padded to 8; the checkpoint holds the 7."""
  seven = {'model.num_layers': 7}
  pipelined = run.setup(config(8, **seven))
  plain = run.setup(config(8, **seven, **{'mesh': dict(stage=1, data=1, fsdp=8, tensor=1)}))
  with pipelined.context():
    state = pipelined.layout.init()
  unpadded = lambda a: a[:7] if a.shape[0] == 8 else a   # the stacked layers' padding cut off
  saved = jax.tree.map(lambda a: unpadded(np.asarray(a)), jax.device_get(state['params']))
  assert pipelined.layout.unpadded and not plain.layout.unpadded
  first = Checkpointer(str(tmp_path / 'a'), keep=1)
  first.save(1, state, {}, {'unpadded': pipelined.layout.unpadded})   # as train/run.py saves
  first.wait()
  on_plain, _ = first.restore(1, plain.layout.abstract)
  layers_per_device = lambda state: (
      state['params']['blocks']['mlp']['gate']['kernel'].addressable_shards[0].data.shape[0])
  assert layers_per_device(on_plain) == 7   # every layer on every device
  second = Checkpointer(str(tmp_path / 'b'), keep=1)
  second.save(1, on_plain, {}, {})
  second.wait()
  back, _ = second.restore(1, pipelined.layout.abstract, pipelined.layout.unpadded)
  assert layers_per_device(back) == 2       # a stage's ceil(7 / 4) layers
  for restored in (on_plain, back):
    for got, want in zip(jax.tree.leaves(jax.device_get(restored['params'])), jax.tree.leaves(saved)):
      np.testing.assert_array_equal(unpadded(got), want)
  first.close()
  second.close()


# ---- refusals --------------------------------------------------------------------------------
@pytest.mark.parametrize('overrides,message', [
    ({'parallel.pipeline_microbatches': 2}, 'parallel.pipeline_microbatches=2 with mesh.stage=4'),
    ({'parallel.pipeline_microbatches': 8}, 'does not divide the 4 rows'),
    ({'parallel.pipeline_schedule': 'zigzag'}, "parallel.pipeline_schedule='zigzag'; allowed"),
    ({'parallel.pipeline_repeats': 2}, "parallel.pipeline_repeats=2 with parallel.pipeline_schedule='gpipe'"),
    ({'parallel.pipeline_schedule': 'circular', 'parallel.pipeline_repeats': 3},
     'model.num_layers=8 cannot give each of mesh.stage=4 x parallel.pipeline_repeats=3 = 12 '
     'chunks a layer'),
    ({'mesh': dict(stage=3, data=1, fsdp=-1, tensor=1)}, 'cannot fill 8 devices'),
    ({'parallel.pipeline_schedule': '1f1b', 'parallel.pipeline_repeats': 2},
     "parallel.pipeline_repeats=2 with parallel.pipeline_schedule='1f1b'"),
    ({'parallel.pipeline_schedule': 'interleaved_1f1b'},
     "parallel.pipeline_repeats=1 with parallel.pipeline_schedule='interleaved_1f1b'"),
    ({'parallel.pipeline_schedule': 'zb_h1', 'parallel.pipeline_repeats': 2},
     'gpipe, 1f1b and zb_h1 hold one chunk per stage'),
    ({'parallel.pipeline_schedule': 'zb_h1', 'parallel.pipeline_microbatches': 2},
     'parallel.pipeline_microbatches=2 with mesh.stage=4; at least 4'),
    ({'parallel.pipeline_schedule': 'interleaved_1f1b', 'parallel.pipeline_repeats': 2,
      'parallel.pipeline_microbatches': 6, 'train.batch_size': 12}, 'use a multiple of 4'),
    ({'precision': 'bf16_mixed', 'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed'},
     'quant.fp8_scaling=delayed with mesh.stage > 1'),
    ({'parallel.pipeline_schedule': '1f1b', 'parallel.pipeline_gather_once': True},
     "parallel.pipeline_gather_once=True with parallel.pipeline_schedule='1f1b': that schedule "
     "always gathers"),
    ({'parallel.zero_stage': 2, 'parallel.pipeline_gather_once': True},
     'parallel.pipeline_gather_once=True with parallel.zero_stage=2: below ZeRO-3'),
    ({'parallel.pipeline_stage_layers': '2,2,4'}, "parallel.pipeline_stage_layers='2,2,4' names "
     '3 chunks; mesh.stage=4 x parallel.pipeline_repeats=1 makes 4'),
    ({'parallel.pipeline_stage_layers': '2,2,2,1'}, 'adds up to 7 layers; model.num_layers=8'),
    ({'parallel.pipeline_stage_layers': '4,0,2,2'}, 'each chunk needs at least one layer'),
    ({'parallel.pipeline_stage_layers': '4;4'}, 'give the layers of each chunk as integers'),
    ({'model.num_layers': 3}, 'model.num_layers=3 cannot give each of mesh.stage=4'),
    ({'model.num_layers': 7, 'lora.rank': 4, 'quant.weights': 'nf4'},
     "quant.weights='nf4' with model.num_layers=7 on mesh.stage=4"),
])
def test_settings_that_do_not_fit_are_refused_in_one_line(overrides, message):
  with pytest.raises(checks.ConfigError, match=re.escape(message)) as e:
    run.setup(config(8, **overrides))
  assert '\n' not in str(e.value)
