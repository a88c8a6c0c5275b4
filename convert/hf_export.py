"""Our parameters out to a Hugging Face checkpoint directory that `transformers` loads.

The architecture follows from the model options (convert/hf_config.py: `arch_of`). Tensors are
converted one HF tensor (of one layer) at a time and written in safetensors shards of at most
`shard_bytes`, so the host holds one shard's worth of converted data at most. Everything is checked
(options, dtype, every parameter's shape, the target) before anything is written, and a target that
exists and is not empty is refused: nothing a user saved is overwritten.
"""
import json
import os

import jax
import ml_dtypes  # noqa: F401  registers bfloat16 with numpy, so tensors can be cast to it
import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from convert.errors import ConvertError
from convert.hf_checkpoint import INDEX_FILE, SINGLE_FILE
from convert.hf_config import arch_of, export_config, write_config
from convert.hf_tensors import GPT2_PREFIX, Link, hf_links
from models.config import ModelConfig

SHARD_BYTES = 5 * 10**9   # transformers' default max_shard_size, "5GB"


@jax.jit
def _take_layer(leaf: jax.Array, i: jax.Array) -> jax.Array:
  # A traced index: one compiled program per parameter shape, not one per layer.
  return leaf[i]


def _layer(leaf, i: int | None) -> np.ndarray:
  """One layer of a stacked leaf (or the whole leaf) as numpy, without copying the other layers."""
  if i is None:
    return np.asarray(leaf)
  if isinstance(leaf, np.ndarray):
    return leaf[i]
  return np.asarray(_take_layer(leaf, i))


def _check_target(out_dir: str) -> None:
  if os.path.exists(out_dir):
    if not os.path.isdir(out_dir):
      raise ConvertError(f'{out_dir} exists and is not a directory; export needs a new or empty '
                         f'directory')
    if os.listdir(out_dir):
      raise ConvertError(f'{out_dir} is not empty ({len(os.listdir(out_dir))} entries); export '
                         f'writes only into a new or empty directory, so nothing saved there is '
                         f'overwritten')


def _check_params(params: dict, links: list[Link], cfg: ModelConfig, arch: str) -> dict:
  """{our path: leaf}, after checking every link has a leaf of its shape and every leaf a link."""
  leaves = traverse_util.flatten_dict(params)
  by_path = {link.path: link for link in links}
  for path in leaves:
    if path in by_path:
      continue
    name = '/'.join(map(str, path))
    if 'lora' in path:
      raise ConvertError(f'params hold a LoRA adapter ({name}); merge the adapters into the '
                         f'kernels first (models.lora.merge) and export the merged parameters')
    if any(path[:k] in by_path for k in range(1, len(path))):
      raise ConvertError(f'params {name} is part of a quantized kernel; export needs float kernels '
                         f'(dequantize, or export the float model it came from)')
    raise ConvertError(f'params {name} has no Hugging Face {arch} tensor; export takes only the '
                       f'model weights (not quantization state such as step sizes or amax history)')
  for path, link in by_path.items():
    expected = link.our_shape(cfg.num_layers)
    if path not in leaves:
      raise ConvertError(f'params have no {"/".join(path)}, which a {arch} model with these '
                         f'options has (shape {expected})')
    shape = tuple(int(n) for n in leaves[path].shape)
    if shape != expected:
      raise ConvertError(f'params {"/".join(path)} has shape {shape}; model_cfg gives {expected}')
  return leaves


def _tensor_plan(links: list[Link], cfg: ModelConfig) -> list[tuple[str, int | None, list[Link]]]:
  """(HF name, layer or None, the links that fill it), unstacked tensors first, then layer by
  layer, so that a shard holds whole layers."""
  grouped: dict[str, list[Link]] = {}
  for link in links:
    grouped.setdefault(link.hf_name, []).append(link)
  plan = [(name, None, parts) for name, parts in grouped.items() if not parts[0].stacked]
  for i in range(cfg.num_layers):
    plan += [(name.format(i=i), i, parts) for name, parts in grouped.items() if parts[0].stacked]
  return plan


def _hf_tensor(leaves: dict, layer: int | None, parts: list[Link], dtype: np.dtype) -> np.ndarray:
  pieces = [link.to_hf(_layer(leaves[link.path], layer)) for link in parts]
  tensor = pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=-1)
  return tensor.astype(dtype, order='C')   # safetensors writes C-ordered bytes; a transpose is not


def _shards(plan: list, dtype: np.dtype, shard_bytes: int) -> list[list]:
  shards, size = [[]], 0
  for entry in plan:
    nbytes = int(np.prod(entry[2][0].hf_shape)) * dtype.itemsize
    if shards[-1] and size + nbytes > shard_bytes:   # a tensor larger than a shard gets its own
      shards.append([])
      size = 0
    shards[-1].append(entry)
    size += nbytes
  return shards


def export_hf(params: dict, model_cfg: ModelConfig, out_dir, dtype: str = 'float32', *,
              shard_bytes: int = SHARD_BYTES) -> list[str]:
  """Writes config.json and the safetensors (one file, or shards with model.safetensors.index.json)
  for `params` (the pure dict of our nnx.Param tree) into `out_dir`; returns the files written."""
  config = export_config(model_cfg, dtype)   # refuses an options mix or a dtype first
  arch = arch_of(model_cfg)
  if not isinstance(shard_bytes, int) or shard_bytes < 1:
    raise ConvertError(f'shard_bytes={shard_bytes!r}; it must be a positive integer (bytes)')
  out_dir = os.fspath(out_dir)
  _check_target(out_dir)
  links = hf_links(arch, model_cfg, GPT2_PREFIX if arch == 'gpt2' else '')
  leaves = _check_params(params, links, model_cfg, arch)
  np_dtype = np.dtype(dtype)
  shards = _shards(_tensor_plan(links, model_cfg), np_dtype, shard_bytes)

  os.makedirs(out_dir, exist_ok=True)
  written = [write_config(config, out_dir)]
  names = ([SINGLE_FILE] if len(shards) == 1 else
           [f'model-{k + 1:05d}-of-{len(shards):05d}.safetensors' for k in range(len(shards))])
  weight_map, total = {}, 0
  for name, shard in zip(names, shards):
    tensors = {hf_name: _hf_tensor(leaves, layer, parts, np_dtype)
               for hf_name, layer, parts in shard}
    path = os.path.join(out_dir, name)
    save_file(tensors, path, metadata={'format': 'pt'})   # transformers refuses files without it
    written.append(path)
    for hf_name, tensor in tensors.items():
      weight_map[hf_name] = name
      total += tensor.nbytes
    del tensors
  if len(shards) > 1:
    index = os.path.join(out_dir, INDEX_FILE)
    with open(index, 'w') as f:
      json.dump({'metadata': {'total_size': total}, 'weight_map': weight_map}, f, indent=2,
                sort_keys=True)
    written.append(index)
  return written
