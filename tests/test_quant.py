"""Quantized matmuls and scaling: error bounds per granularity, the int8 product against an integer
reference, straight-through and LSQ gradients, every mode training under ZeRO-3, and bad input."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs.recipes import RECIPES, recipe_config
from quant import fp8, lsq
from quant.matmul import quantized_dot
from quant.recipe import MatmulRecipe
from tests import qwix_scaling as scaling
from tests.helpers import reordered_rtol, tiny_config
from tests.test_layouts import config_for, losses, train_from
from train import checks, run


def _matrix(rows=64, cols=32, seed=0):
  # Columns of very different magnitudes, so per-channel and per-tensor scales differ.
  x = jax.random.normal(jax.random.key(seed), (rows, cols))
  return x * jnp.linspace(0.1, 10.0, cols)


@pytest.mark.parametrize('fmt', sorted(scaling.QTYPES))
@pytest.mark.parametrize('granularity', scaling.GRANULARITIES)
def test_round_trip_error_is_within_the_format_bound(fmt, granularity):
  x = _matrix()
  q = scaling.quantize(x, fmt, granularity, block_size=16)
  err = jnp.abs(x - scaling.dequantize(q).astype(jnp.float32))
  bound = scaling.error_bound(x, q, fmt)
  assert bool(jnp.all(err <= bound * (1 + 1e-4) + 1e-7)), float((err / bound).max())
  expected_scales = {'tensor': (1, 1), 'channel': (1, 32), 'token': (64, 1), 'block': (4, 32)}
  assert q.scale.shape == expected_scales[granularity]


def test_finer_granularity_is_more_accurate_on_uneven_columns():
  x = _matrix()
  error = {g: float(jnp.abs(x - scaling.dequantize(scaling.quantize(x, 'int8', g, 16))).mean())
           for g in ('tensor', 'channel', 'block')}
  assert error['block'] < error['channel'] < error['tensor'] / 2


def test_the_int8_product_equals_an_integer_reference():
  """Per-token activation and per-channel weight scales, integer accumulation, then rescale."""
  x, w = _matrix(16, 64, seed=1), _matrix(64, 24, seed=2)
  got = np.asarray(quantized_dot(x, w, 1, MatmulRecipe(mode='int8')), np.float64)
  qx, qw = scaling.quantize(x, 'int8', 'token'), scaling.quantize(w, 'int8', 'channel')
  # Integer codes are the scaled values rounded to nearest; Qwix maps absmax to 127.5, so the
  # largest magnitude can round to -128 (the otherwise unused code) but never past the int8 range.
  for a, q in ((x, qx), (w, qw)):
    codes = np.asarray(q.qvalue, np.int64)
    assert codes.min() >= -128 and codes.max() <= 127
    # x * (1 / scale) vs x / scale can differ in the last bit right at a .5 tie: at most one step.
    assert np.abs(codes - np.round(np.asarray(a) / np.asarray(q.scale))).max() <= 1
  accumulated = np.asarray(qx.qvalue, np.int64) @ np.asarray(qw.qvalue, np.int64)  # exact integers
  reference = accumulated * np.asarray(qx.scale, np.float64) * np.asarray(qw.scale, np.float64)
  np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * np.abs(reference).max())


def test_the_int8_product_accumulates_in_int32_on_this_backend():
  x, w = _matrix(8, 64), _matrix(64, 16)
  hlo = jax.jit(lambda a, b: quantized_dot(a, b, 1, MatmulRecipe(mode='int8'))).lower(x, w) \
      .compile().as_text()
  dots = [line for line in hlo.splitlines() if ' dot(' in line]
  assert dots and all('= s32[' in line for line in dots), dots
  assert 's8[8,64]' in hlo and 's8[64,16]' in hlo   # both operands are int8 codes


@pytest.mark.parametrize('recipe', [MatmulRecipe(mode='int8'), MatmulRecipe(mode='int4'),
                                    MatmulRecipe(mode='llm_int8')])
def test_straight_through_gradients_equal_the_unquantized_ones(recipe):
  x, w = _matrix(8, 64, seed=3) / 10, _matrix(64, 16, seed=4) / 10

  def loss(product, x, w):
    return (product(x, w) ** 2).sum()

  plain = lambda a, b: a @ b
  quantized = lambda a, b: quantized_dot(a, b, 1, recipe)
  got = jax.grad(lambda x, w: (plain(x, w) * quantized(x, w)).sum(), argnums=(0, 1))(x, w)
  # d/dx sum(P * Q) with Q's gradient straight through = g @ w.T where g = P (same for w).
  g = plain(x, w)
  want = (g @ w.T + quantized(x, w) @ w.T, x.T @ g + x.T @ quantized(x, w))
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_lsq_gradients_follow_the_paper():
  """d w_q / d w = 1 inside the clip range and 0 outside; d w_q / d s = (round(w/s) - w/s) inside,
  qmin or qmax outside, times g = 1/sqrt(N qmax)."""
  w = jnp.array([[0.05, -0.31, 2.0], [0.26, -3.0, 0.12]])     # [in=2, out=3]
  s = jnp.array([0.1, 0.1, 0.2])
  grad_w, grad_s = jax.grad(lambda w, s: lsq.fake_quantize(w, s, 1, bits=4).sum(), (0, 1))(w, s)
  v = np.asarray(w / s)
  inside = (v >= -8) & (v <= 7)
  np.testing.assert_array_equal(grad_w, inside.astype(np.float32))
  per_value = np.where(inside, np.round(v) - v, np.clip(v, -8, 7))
  np.testing.assert_allclose(grad_s, per_value.sum(0) / np.sqrt(2 * 7), rtol=1e-5, atol=1e-6)


def test_learned_step_sizes_receive_gradients_and_change():
  config = config_for('fsdp', **{'quant.mode': 'int4', 'quant.learned_scale': True})
  from train import run
  s = run.setup(config)
  state = s.layout.init()
  before = jax.tree.map(np.asarray, state['params']['blocks']['mlp']['down']['step_size'])
  from tests.test_layouts import batches
  for batch in batches(2):
    with s.context():
      state, _ = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                      for k, v in batch.items()})
  after = np.asarray(state['params']['blocks']['mlp']['down']['step_size'])
  assert before.shape == after.shape == (4, 64)   # [layers, embed]: one per output channel
  assert np.abs(after - before).min() > 0


def test_fp8_delayed_scaling_takes_its_scales_from_the_history_and_returns_its_update():
  x, w = _matrix(8, 64, seed=5), _matrix(64, 16, seed=6) / 10
  cotangent = jax.random.normal(jax.random.key(7), (8, 16))
  empty = jnp.zeros((3, 4))
  y, pullback = jax.vjp(lambda x, w, h: fp8.fp8_delayed_dot(x, w, h, 1), x, w, empty)
  _, _, update = pullback(cotangent)
  # With nothing recorded the scale is 1, never the tensor's own amax: the operands are cast as
  # they are. The update pushes their maxima, for the next step.
  amaxes = [jnp.abs(x).max(), jnp.abs(w).max(), jnp.abs(cotangent).max()]
  np.testing.assert_allclose(update[:, 0], amaxes, rtol=1e-6)
  np.testing.assert_array_equal(update[:, 1:], 0)
  as_e4m3 = lambda a: a.astype(jnp.float8_e4m3fn).astype(jnp.float32)
  np.testing.assert_allclose(y, as_e4m3(x) @ as_e4m3(w), rtol=1e-6, atol=1e-6)
  # A history scales the tensor by fp8 max / its amax, whatever the tensor's own amax is.
  recorded = empty.at[0, 1].set(2.0).at[1, 3].set(4.0)
  scaled = fp8.fp8_delayed_dot(x, w, recorded, 1)
  cast = lambda a, amax: as_e4m3(jnp.clip(a * (448 / amax), -448, 448)) / (448 / amax)
  np.testing.assert_allclose(scaled, cast(x, 2.0) @ cast(w, 4.0), rtol=1e-6, atol=1e-6)
  # A history whose max is below the tensor's clips the tensor there (e4m3 max = 448).
  history = empty.at[0, 2].set(1.0).at[1, 0].set(float(amaxes[1]))
  clipped = fp8.fp8_delayed_dot(x, w, history, 1)
  reference = fp8.fp8_delayed_dot(jnp.clip(x, -1, 1), w, history, 1)
  np.testing.assert_array_equal(clipped, reference)
  # The backward multiplies the gradient in e5m2 by the kernel in e4m3 (dx), and the input in e4m3
  # by the gradient (dw), each scaled as its history says.
  recorded = recorded.at[2, 0].set(8.0)
  dx, dw = jax.vjp(lambda x, w: fp8.fp8_delayed_dot(x, w, recorded, 1), x, w)[1](cotangent)
  as_e5m2 = lambda a, amax: (jnp.clip(a * (57344 / amax), -57344, 57344).astype(jnp.float8_e5m2)
                             .astype(jnp.float32) / (57344 / amax))
  np.testing.assert_allclose(dx, as_e5m2(cotangent, 8.0) @ cast(w, 4.0).T, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(dw, cast(x, 2.0).T @ as_e5m2(cotangent, 8.0), rtol=1e-5, atol=1e-6)
  _, pullback = jax.vjp(lambda h: fp8.fp8_delayed_dot(x, w, h, 1), history)
  (update,) = pullback(cotangent)
  np.testing.assert_allclose(history + update, jnp.stack([
      jnp.array([amaxes[0], 0, 0, 1.0]), jnp.array([amaxes[1], amaxes[1], 0, 0]),
      jnp.array([amaxes[2], 0, 0, 0])]), rtol=1e-6)


def test_fp8_histories_fill_one_entry_per_step_and_skip_adam():
  config = config_for('fsdp', **{'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed'})
  from train import run
  from tests.test_layouts import batches
  s = run.setup(config)
  state = s.layout.init()
  for batch in batches(3):
    with s.context():
      state, _ = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                      for k, v in batch.items()})
  history = np.asarray(state['params']['blocks']['mlp']['down']['amax_history'])
  assert history.shape == (4, 3, 16)                  # [layers, (x, kernel, gradient), steps]
  assert (history[:, :, :3] > 0).all() and (history[:, :, 3:] == 0).all()
  # The kernel's recorded max is the max of the kernel it saw (before that step's update).
  assert 0.5 < history[0, 1, 0] / history[0, 1, 2] < 2


MODES = {'int8': {}, 'int8_backward': {'quant.int8_backward': True}, 'int4': {},
         'int4_learned': {'quant.learned_scale': True}, 'fp8': {}, 'llm_int8': {},
         'int8_blocks': {'quant.block_size': 16}, 'fp8_delayed': {'quant.fp8_scaling': 'delayed'}}
# Each mode's largest rounding step, as a fraction of the range its scale covers (a row's, channel's
# or block's absmax; LSQ's clip range): int8 1/127, int4 1/7, e4m3 32/448 = 1/14 (its top binade).
ROUNDING_STEP = {'int8': 1 / 127, 'int8_backward': 1 / 127, 'int8_blocks': 1 / 127,
                 'llm_int8': 1 / 127, 'int4': 1 / 7, 'int4_learned': 1 / 7, 'fp8': 1 / 14,
                 'fp8_delayed': 1 / 14}
WEIGHT_ONLY = ('int4', 'int4_learned')   # activations stay fp32: nothing to flip while kernels agree


# Relative size of the nudges below: 2 to 4 ulps, what summing in another order does to a value.
NUDGE = 2.0 ** -22


def one_device_losses_and_spread(config, replicas=8):
  """One device's losses, and per step the furthest from them that `replicas` runs land whose
  embedding and norm scales start nudged by a few ulps (at random, value by value). Like another
  layout's summation order, that changes the activations' last bits but not the first step's
  kernels, and the spread is how far such differences move this format's losses: by flipping its
  roundings, which Adam's sign-like first steps then carry into other weights."""
  s = run.setup(config, jax.devices()[:1])
  start = jax.tree.map(np.asarray, s.layout.init())
  run_from = lambda state: np.asarray(train_from(s, jax.device_put(state, s.layout.shardings)))
  reference, rng = run_from(start), np.random.default_rng(0)

  def nudge(path, w):
    if jax.tree_util.keystr(path[-1:]) not in ("['embedding']", "['scale']"):
      return w   # kernels (and their step sizes or amax histories) as they are
    return (w * (1 + NUDGE * rng.integers(-1, 2, w.shape))).astype(w.dtype)
  spread = np.zeros_like(reference)
  for _ in range(replicas):
    nudged = run_from({**start, 'params': jax.tree_util.tree_map_with_path(nudge, start['params'])})
    spread = np.maximum(spread, np.abs(nudged - reference))
  return reference, spread


@pytest.fixture(scope='module')
def unquantized_zero3_losses():
  return losses(config_for('fsdp'))[0]


@pytest.mark.parametrize('name', sorted(MODES))
def test_every_mode_trains_under_zero3_like_on_one_device(name, unquantized_zero3_losses):
  mode = 'llm_int8' if name == 'llm_int8' else name.split('_')[0]
  overrides = {'quant.mode': mode, **MODES[name]}
  sharded, s = losses(config_for('fsdp', **overrides))
  assert s.mesh.shape['fsdp'] == 8 and s.policy.matmul.mode == mode
  single, spread = one_device_losses_and_spread(config_for('ddp', **overrides))
  tokens = s.config.train.batch_size * s.config.train.seq_len
  # ZeRO-3 sums in another order. In fp32 that moves the loss, a mean over the batch's tokens, by
  # reordered_rtol(tokens) of itself at most. But a value pushed across a rounding boundary of the
  # format moves by a whole step, ROUNDING_STEP of its scale's range: counted as that fraction of its
  # token's loss, ROUNDING_STEP * loss / tokens of the mean. That can happen in the first step (in
  # the second for weight-only modes, whose kernels are identical until the first update), and
  # Adam's sign-like first steps carry it into other weights: so the run may also land within 3x
  # the spread of one-device runs nudged in their last bits (it is one more draw of those).
  for step, (got, want, noise) in enumerate(zip(sharded, single, spread)):
    flip = 0 if step == 0 and name in WEIGHT_ONLY else ROUNDING_STEP[name] * want / tokens
    np.testing.assert_allclose(got, want, rtol=reordered_rtol(tokens), atol=max(flip, 3 * noise),
                               err_msg=f'step {step}')
  # Quantized, yet close to the unquantized run (and not identical to it: the mode is in effect;
  # without it this would be the baseline's very program on the same devices, equal bit for bit).
  np.testing.assert_allclose(sharded, unquantized_zero3_losses, rtol=5e-3)
  assert sharded != unquantized_zero3_losses


@pytest.mark.parametrize('name', sorted(RECIPES))
def test_every_recipe_config_builds_its_policy(name):
  config = recipe_config(name, 'tiny')
  policy = checks.policy(config)
  assert policy.matmul.mode == config.quant.mode


@pytest.mark.parametrize('overrides, message', [
    ({'quant.mode': 'int3'}, "quant.mode='int3'; allowed: none, int8, int4, fp8, llm_int8"),
    ({'quant.mode': 'int8', 'quant.block_size': 24}, 'quant.block_size=24 does not divide model.d_model=64'),
    ({'quant.mode': 'int4', 'model.mlp_dim': 129}, 'model.mlp_dim=129 is odd'),
    ({'quant.mode': 'llm_int8', 'quant.threshold': 0.0}, 'quant.threshold=0.0; allowed: a number > 0'),
    ({'quant.mode': 'fp8', 'quant.learned_scale': True}, 'applies to quant.mode=int4 only'),
    ({'quant.mode': 'none', 'quant.block_size': 32}, 'applies to modes int8, int4 and fp8'),
    ({'quant.mode': 'fp8', 'quant.fp8_scaling': 'lagged'}, "allowed: current, delayed"),
    ({'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed', 'precision': 'fp16'},
     'cannot run under precision=.fp16.'),
    ({'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed', 'quant.amax_history': 0},
     'quant.amax_history=0; allowed: an integer >= 1'),
])
def test_bad_quantization_settings_are_refused_naming_what_is_allowed(overrides, message):
  with pytest.raises(checks.ConfigError, match=message):
    checks.policy(tiny_config(**overrides))


def test_fp8_delayed_scales_and_losses_do_not_depend_on_the_layout():
  """The history records the batch's amax (the max over microbatches and devices, not their mean),
  so one device, DDP with per-device accumulation and ZeRO-3 record the same amaxes and scale alike.
  Values differ only by fp32 summation order upstream (and an fp8 rounding that order may flip);
  a mean of per-device maxima would sit far below (a device's 4 rows of the 16)."""
  overrides = {'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed', 'train.batch_size': 16,
               'train.microbatches': 2}
  histories, got = {}, {}
  for layout, devices in (('ddp', 1), ('ddp', 8), ('fsdp', 8)):
    s = run.setup(config_for(layout, **overrides), jax.devices()[:devices])
    state = s.layout.init()
    from tests.test_layouts import batches
    out = []
    for batch in batches(3, rows=16):
      with s.context():
        state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                              for k, v in batch.items()})
      out.append(float(metrics['loss']))
    key = f'{layout}x{devices}'
    got[key] = out
    histories[key] = np.asarray(state['params']['blocks']['mlp']['down']['amax_history'])
  one = histories['ddpx1']
  assert (one[:, :, :3] > 0).all()
  for key in ('ddpx8', 'fsdpx8'):
    # One e4m3 step (2**-3 relative) bounds what a flipped fp8 rounding upstream moves an amax.
    np.testing.assert_allclose(histories[key], one, rtol=2.0**-3)
    np.testing.assert_allclose(got[key], got['ddpx1'], rtol=1e-3)
