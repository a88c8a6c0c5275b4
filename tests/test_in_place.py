"""parallel/in_place.py: a state changed under a predicate stays in place on XLA:CPU and XLA:GPU,
and a tick that does not change it hands it back as it was."""
import numpy as np
import pytest


@pytest.mark.parametrize('compiler', ['XLA:CPU', 'XLA:GPU'])
def test_an_action_changes_its_state_in_place_and_other_ticks_leave_it_as_it_was(compiler):
  """`when` as ZB-H1's tick runs it: in a loop of ticks one action writes a slot of a store and
  another adds a slot to a sum. Both compilers keep both in place (with a `lax.cond`, the branch
  that hands its state back copies it whole, every tick: on XLA:GPU where it is the false branch,
  on jax 0.10.2's XLA:CPU where it is the true one), and the values are a plain loop's."""
  import re

  import jax
  import jax.numpy as jnp
  from jax.sharding import SingleDeviceSharding

  from parallel import target as target_lib
  from parallel.in_place import when
  from plan.target import compile_devices, parse_target

  if compiler == 'XLA:GPU' and target_lib.plugin() is None:
    pytest.skip('the CUDA plugin of jax is not installed: pip install -r '
                'requirements-gpu-compile.txt')
  device = (jax.devices()[0] if compiler == 'XLA:CPU'
            else compile_devices(parse_target('1xH100-80GB'))[0])
  slots, width, ticks = 5, 1 << 14, 12

  def tick(carry, t):
    store, sums = carry
    slot = t % slots
    row = lambda: t + jnp.arange(width, dtype=jnp.float32)
    store = when(t % 3 == 0, lambda store, _: store.at[slot].set(row()), store, t)
    sums = when(t % 3 == 2, lambda sums, store: sums + store[slot], sums, store)
    return (store, sums), None

  placed = SingleDeviceSharding(device)
  run = jax.jit(lambda store, sums: jax.lax.scan(tick, (store, sums), jnp.arange(ticks))[0],
                donate_argnums=(0, 1), in_shardings=(placed, placed), out_shardings=placed)
  start = (np.zeros((slots, width), np.float32), np.zeros(width, np.float32))
  program = run.lower(*start).compile().as_text()
  copied = re.findall(rf'= f32\[(?:{slots},)?{width}\]\{{[^}}]*\}} copy\(', program)
  assert not copied, copied
  if compiler == 'XLA:GPU':
    return   # compiled for GPUs that are not here: nothing to run

  store, sums = start[0].copy(), start[1].copy()
  for t in range(ticks):
    if t % 3 == 0:
      store[t % slots] = t + np.arange(width, dtype=np.float32)
    if t % 3 == 2:
      sums += store[t % slots]
  got_store, got_sums = run(*start)
  # Integers below 2**24, and sums of four of them: exact in float32.
  np.testing.assert_array_equal(got_store, store)
  np.testing.assert_array_equal(got_sums, sums)
