"""Which parameters weight decay applies to, by name: one rule for the optimizer and the train state.

Weights that multiply (dense kernels, embedding and position tables, LoRA's A and B) decay; what
shifts or rescales (biases, norm scales), learned quantization step sizes (LSQ) and fp8 amax
histories do not. The name decides, not the rank: a bias may be a matrix (GPT-2's query bias is
[heads, head_dim]) and every tensor under the scanned stack has a leading `layers` dimension. The
same rule tells the train state which frozen weights are stored in the compute dtype
(train/state.py).
"""
import jax

MATRIX_NAMES = ('kernel', 'embedding', 'positions')   # a table of positions is an embedding
ADAPTER_NAMES = ('a', 'b')                              # under `lora`: the adapters' two factors


def _names(path) -> list:
  return [getattr(key, 'key', getattr(key, 'name', None)) for key in path]


def is_matrix_weight(path) -> bool:
  """Whether the parameter at `path` (a tree_map_with_path key path) multiplies its input."""
  names = _names(path)
  if not names:
    return False
  return names[-1] in MATRIX_NAMES or (
      names[-1] in ADAPTER_NAMES and len(names) > 1 and names[-2] == 'lora')


def weight_decay_mask(params):
  """True where AdamW decays: the matrix weights."""
  return jax.tree_util.tree_map_with_path(lambda path, _: is_matrix_weight(path), params)
