"""The train step's jit: the state is donated to it, but for the leaves it holds back.

A donated argument's buffer becomes the step's output, so XLA writes a new value there. Where the
step builds the new value somewhere else first, it then copies it across: the offloaded
optimizer's layer stacks (train/offload.py) are read a layer at a time from the old stacks and
written into new ones in host memory, and with the old ones donated, XLA:GPU then copies every new
stack into the old one's buffer (at 1b, 27 copies within host memory, 10.88 GiB a step, in the
program compiled without a device for one H200; not yet timed on one). Held back, the
new stacks are the outputs themselves; host memory holds the old and the new stacks during the step
either way. `HeldBack` is the jit with those leaves in an argument of their own, not donated, with
the call, `lower` and the compiled step still taking the whole state.
"""
import jax


class HeldBack:
  """`step_fn(state, batch)` jitted with the leaves of `state` where `held` (a tree like it, of
  bools) is True passed undonated, and the rest donated; compiled with `compiler_options`
  (jax.jit's)."""

  def __init__(self, step_fn, held, state_shardings, batch_sharding, metrics_sharding,
               compiler_options=None):
    self._held = jax.tree.leaves(held)
    self._treedef = jax.tree.structure(held)

    def train_step(held_leaves, donated_leaves, batch):   # the program's name, as unheld
      return step_fn(self._join(held_leaves, donated_leaves), batch)
    self._jitted = jax.jit(train_step, in_shardings=(*self._split(state_shardings), batch_sharding),
                           out_shardings=(state_shardings, metrics_sharding), donate_argnums=1,
                           compiler_options=compiler_options)

  def _split(self, state):
    leaves = self._treedef.flatten_up_to(state)
    return ([x for x, h in zip(leaves, self._held) if h],
            [x for x, h in zip(leaves, self._held) if not h])

  def _join(self, held_leaves, donated_leaves):
    held, donated = iter(held_leaves), iter(donated_leaves)
    return self._treedef.unflatten([next(held) if h else next(donated) for h in self._held])

  def __call__(self, state, batch):
    return self._jitted(*self._split(state), batch)

  def lower(self, state, batch):
    return _Lowered(self._jitted.lower(*self._split(state), batch), self._split)


class _Lowered:
  """A lowered step that compiles to one taking the whole state."""

  def __init__(self, lowered, split):
    self._lowered, self._split = lowered, split

  def compile(self, *args, **kwargs):   # compiler_options, as jax's (parallel/collectives.py)
    return _Compiled(self._lowered.compile(*args, **kwargs), self._split)

  def __getattr__(self, name):
    return getattr(self._lowered, name)


class _Compiled:
  """A compiled step called with the whole state; its program's text, memory and costs as JAX's."""

  def __init__(self, compiled, split):
    self._compiled, self._split = compiled, split

  def __call__(self, state, batch):
    return self._compiled(*self._split(state), batch)

  def __getattr__(self, name):
    return getattr(self._compiled, name)
