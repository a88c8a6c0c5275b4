"""Orbax checkpoints of the train state and the data iterator's position.

Saves are asynchronous (training goes on while the arrays are written). Restore reads into an
abstract target built under the *current* mesh, so a checkpoint restores onto any layout. Before a
restore the stored shapes are compared with the model's, so a workdir from a different model
gives one clear error instead of an orbax traceback.
"""
import os

import jax
import orbax.checkpoint as ocp


class CheckpointError(ValueError):
  pass


class Checkpointer:

  def __init__(self, directory: str, *, keep: int):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict) -> None:
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state)))

  def check_shapes(self, step: int, abstract_state) -> None:
    """Raise CheckpointError naming the first tensor whose stored shape differs from the model's."""
    stored = self._manager.item_metadata(step)['state']
    stored_params = _shapes(stored['params'])
    wanted_params = _shapes(abstract_state['params'])
    for name in sorted(set(stored_params) | set(wanted_params)):
      have, want = stored_params.get(name), wanted_params.get(name)
      if have != want:
        raise CheckpointError(
            f'{os.path.join(self.directory, str(step))} holds a different model: params/{name} has '
            f'shape {have} there but {want} in this config; use a fresh --workdir or the config '
            f'that wrote it ({os.path.dirname(self.directory)}/config.json)')

  def restore_data(self, step: int) -> dict:
    """The data iterator's state alone: small, read before anything is compiled."""
    return self._manager.restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore()))['data']

  def restore_state(self, step: int, abstract_state):
    """The train state, placed as `abstract_state`'s shardings say (any mesh)."""
    restored = self._manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state)))
    return restored['state']

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def _shapes(tree) -> dict[str, tuple]:
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  return {'/'.join(str(getattr(k, 'key', k)) for k in path): tuple(leaf.shape) for path, leaf in flat}
