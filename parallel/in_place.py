"""A state changed where a predicate holds and left as it was elsewhere, in the form XLA keeps in
place: each action of ZB-H1's tick (the slot stores, the gradients' sums), and the train step's
skip of a non-finite update (train/step.py:updated_if_finite).

`lax.cond(p, change, keep)` is the plain spelling, and each compiler copies the state whole at
every call for one of its two orders: XLA:GPU where the branch that hands the state back is the
false one, jax 0.10.2's XLA:CPU where it is the true one (0.12.0.1's keeps either). A switch on an
integer whose first branch hands the state back is kept in place by both (tests/test_in_place.py
compiles a loop of such updates for each).
"""
import jax
import jax.numpy as jnp


def when(happens, change, state, *reads):
  """`change(state, *reads)` where `happens` (a boolean scalar), else `state` itself."""
  return jax.lax.switch(jnp.asarray(happens, jnp.int32), [lambda state, *_: state, change],
                        state, *reads)
