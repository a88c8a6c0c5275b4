"""ZB-H1's tables (parallel/zero_bubble.py), run with labels in place of activations: every
dependency is met when its action runs, no slot is written while another microbatch holds it, and
the bubble is ZB-H1's, a third of 1F1B's."""
import numpy as np
import pytest

from parallel.pipeline import PipelineSchedule
from parallel.zero_bubble import BACKWARD_INPUT, BACKWARD_WEIGHTS, FORWARD, zb_h1

CASES = [(4, 32), (4, 8), (4, 4), (2, 2), (2, 5), (3, 7), (8, 8), (8, 32)]


def run_with_labels(t):
  """Each stage's slots hold (microbatch, what): an input ('x', stage) from its arrival, the
  gradient of the stage's output ('dy', stage + 1) from its arrival (or the loss's, on the last
  stage), and are emptied by W. Returns the tick of each (action, stage, microbatch)."""
  P = t.stages
  inputs = [[None] * t.slots for _ in range(P)]
  grads = [[None] * t.slots for _ in range(P)]
  sent_forward, sent_backward, when = [None] * P, [None] * P, {}
  for tick in range(t.ticks):
    for p in range(P):   # what the neighbours sent at the tick before
      if t.forward_arrives[tick, p]:
        m = t.forward_micro[tick, p]
        assert sent_forward[p - 1] == (m, 'x', p), (tick, p)
        assert inputs[p][m % t.slots] is None, f'tick {tick}: stage {p} overwrites a held input'
        inputs[p][m % t.slots] = (m, 'x', p)
      if t.backward_arrives[tick, p]:
        m = t.backward_micro[tick, p]
        assert sent_backward[p + 1] == (m, 'dy', p + 1), (tick, p)
        assert inputs[p][m % t.slots] == (m, 'x', p) and grads[p][m % t.slots] is None, (tick, p)
        grads[p][m % t.slots] = (m, 'dy', p + 1)
    sent_forward, sent_backward = [None] * P, [None] * P
    for p in range(P):
      action, m = t.action[tick, p], t.micro[tick, p]
      slot = m % t.slots
      if action == FORWARD:
        if p == 0:
          assert inputs[0][slot] is None, f'tick {tick}: the first stage overwrites a held input'
          inputs[0][slot] = (m, 'x', 0)   # the embedding's output
        assert inputs[p][slot] == (m, 'x', p), (tick, p)
        sent_forward[p] = (m, 'x', p + 1)
        if p == P - 1:
          grads[p][slot] = (m, 'dy', P)   # the loss's gradient
      elif action == BACKWARD_INPUT:
        assert grads[p][slot] == (m, 'dy', p + 1) and inputs[p][slot] == (m, 'x', p), (tick, p)
        sent_backward[p] = (m, 'dy', p)
      elif action == BACKWARD_WEIGHTS:
        assert ('B', p, m) in when and grads[p][slot] == (m, 'dy', p + 1), (tick, p)
        inputs[p][slot] = grads[p][slot] = None
      if action:
        key = ('.FBW'[action], p, m)
        assert key not in when, f'{key} twice'
        when[key] = tick
  return when


@pytest.mark.parametrize('stages,microbatches', CASES)
def test_every_action_finds_what_it_needs_and_leaves_the_others_slots_alone(stages, microbatches):
  P, M = stages, microbatches
  t = zb_h1(P, M)
  when = run_with_labels(t)
  assert len(when) == 3 * P * M   # each microbatch's F, B and W on every stage, once
  for p in range(P):
    assert [when[('F', p, m)] for m in range(M)] == sorted(when[('F', p, m)] for m in range(M))
    for m in range(M):
      assert when[('F', p, m)] < when[('B', p, m)] < when[('W', p, m)]


@pytest.mark.parametrize('stages,microbatches', CASES)
def test_the_bubble_is_zb_h1s(stages, microbatches):
  """(P - 1) idle ticks per stage, against 1F1B's (P - 1) x (F + B + W); at 4 stages and 32
  microbatches (issue 50's point) at most 0.4x 1F1B's bubble."""
  P, M = stages, microbatches
  t = zb_h1(P, M)
  assert t.ticks == 3 * M + P - 1
  assert t.bubble_fraction == pytest.approx((P - 1) / (3 * M + P - 1))
  one_f_one_b = PipelineSchedule('1f1b', P, M).bubble_fraction
  assert t.bubble_fraction < one_f_one_b
  if (P, M) == (4, 32):
    assert t.bubble_fraction <= 0.4 * one_f_one_b


def test_too_few_microbatches_are_refused():
  with pytest.raises(ValueError, match='microbatches=3 with 4 stages; at least 4'):
    zb_h1(4, 3)


def test_a_table_prints_a_line_per_tick():
  lines = zb_h1(2, 2).text().split('\n')
  assert lines[0].split() == ['F0', '.'] and len(lines) == zb_h1(2, 2).ticks
  assert np.all(zb_h1(2, 2).slot < 3)


def test_a_pullbacks_per_microbatch_residuals_hold_no_weights_and_rebuild_it():
  """The leaves a zb_h1 stage keeps per microbatch (parallel/pipeline_zb.py:Residuals) are the
  ones that depend on the microbatch: activations, not the weights or their bf16 casts (which
  would be a copy of the stage's weights per slot); the pullback rebuilt from them and the
  once-per-step leaves gives autodiff's gradients."""
  import jax
  import jax.numpy as jnp
  from parallel.pipeline_zb import Residuals
  layers, d, rows = 3, 24, 5
  weights = [jax.random.normal(jax.random.PRNGKey(0), (layers, d, d)) / d ** 0.5]
  x = jax.random.normal(jax.random.PRNGKey(1), (rows, d))

  def pullback(trained, x, rows_now, keys):
    def apply(trained, x):
      def layer(x, w):
        return jnp.tanh(x @ w.astype(jnp.bfloat16).astype(jnp.float32)) + x, None
      return jax.lax.scan(layer, x, trained[0])[0]
    return jax.vjp(apply, trained, x)

  def check(weights, x):
    residuals = Residuals.of(pullback, weights, x, None, None)
    y, pull = pullback(weights, x, None, None)
    kept = residuals.per_item(pull)
    assert kept and all(k.size < layers * d * d for k in kept)   # [layers, rows, d] at most
    dy = jnp.ones_like(y)
    return residuals.pullback(kept)(dy), pull(dy)

  rebuilt, direct = jax.jit(check)(weights, x)
  for a, b in zip(jax.tree.leaves(rebuilt), jax.tree.leaves(direct)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
