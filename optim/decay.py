"""Which parameters weight decay applies to, by the rank of one layer's tensor.

Matrices (projections, embeddings) decay; vectors (norm scales) do not. The scanned stack adds a
leading `layers` dimension to everything under `blocks`, so a stacked norm scale is 2-D: the rank
that counts is one layer's, read from the path. The same rank tells the train state which frozen
weights are matrices (train/state.py).
"""
import jax


def layer_ndim(path, leaf) -> int:
  """The rank of one layer's tensor at `path` (a tree_map_with_path key path)."""
  names = [getattr(key, 'key', None) for key in path]
  return leaf.ndim - int('blocks' in names)


def weight_decay_mask(params):
  """True where AdamW decays: matrices, never learned quantization step sizes (LSQ)."""
  def decays(path, leaf):
    if getattr(path[-1], 'key', None) == 'step_size':   # LSQ step sizes are not weights
      return False
    return layer_ndim(path, leaf) >= 2
  return jax.tree_util.tree_map_with_path(decays, params)
