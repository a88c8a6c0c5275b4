"""A local Hugging Face checkpoint directory, read one of our parameters at a time.

Only the safetensors headers are read when the directory is opened (tensor names, shapes and which
file holds each). `read` then streams the tensors of one parameter out of the memory-mapped files,
so a 7B checkpoint is never held twice in host memory. Every shape is checked against the
checkpoint's config.json before a byte of data is converted.
"""
import contextlib
import json
import os
from typing import Any

import ml_dtypes  # noqa: F401  registers bfloat16 with numpy: safe_open(framework='numpy') needs it
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from convert.errors import ConvertError
from convert.hf_config import architecture, load_config, model_fields
from convert.hf_tensors import GPT2_PREFIX, Link, hf_links, ignored
from models.config import ModelConfig

SINGLE_FILE = 'model.safetensors'
INDEX_FILE = 'model.safetensors.index.json'   # sharded: a weight_map from tensor name to file


def _shape(shape) -> tuple[int, ...]:
  return tuple(int(n) for n in shape)


class HFCheckpoint:
  """A checkpoint folder: `.arch` ('llama' | 'gpt2'), `.model_fields()`,
  `.read(path, shape, dtype)`, `.read_all(template)`."""

  def __init__(self, directory):
    self.directory = os.fspath(directory)
    if not os.path.isdir(self.directory):
      raise ConvertError(f'{self.directory} is not a directory; expected a Hugging Face checkpoint '
                         f'folder (config.json and {SINGLE_FILE})')
    self._config_path = os.path.join(self.directory, 'config.json')
    if not os.path.isfile(self._config_path):
      raise ConvertError(f'{self.directory} has no config.json; a Hugging Face checkpoint folder '
                         f'(save_pretrained) has one')
    self.config = load_config(self._config_path)
    self.arch = architecture(self.config, self._config_path)
    self._fields = model_fields(self.config, self.arch, self._config_path)
    self._cfg = ModelConfig(**self._fields)
    self._files, self._shapes = self._index_tensors()
    prefix = GPT2_PREFIX if any(n.startswith(GPT2_PREFIX) for n in self._shapes) else ''
    self._links = {link.path: link for link in hf_links(self.arch, self._cfg, prefix)}
    self._check_nothing_unmapped()

  def model_fields(self) -> dict[str, Any]:
    """ModelConfig fields for this checkpoint (everything but remat and init_std)."""
    return dict(self._fields)

  # ---- files ---------------------------------------------------------------------------------
  def _index_tensors(self) -> tuple[dict[str, str], dict[str, tuple[int, ...]]]:
    """Tensor name -> file, and tensor name -> shape, from the safetensors headers alone."""
    single = os.path.join(self.directory, SINGLE_FILE)
    index = os.path.join(self.directory, INDEX_FILE)
    if os.path.isfile(single):
      paths = [single]
    elif os.path.isfile(index):
      try:
        with open(index) as f:
          weight_map = json.load(f)['weight_map']
        paths = [os.path.join(self.directory, name) for name in sorted(set(weight_map.values()))]
      except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ConvertError(f'{index} is not a safetensors index (a JSON object with a weight_map '
                           f'from tensor name to file)') from None
      for path in paths:
        if not os.path.isfile(path):
          raise ConvertError(f'{path} is missing; {INDEX_FILE} lists it as a shard')
    elif any(os.path.exists(os.path.join(self.directory, n))
             for n in ('pytorch_model.bin', 'pytorch_model.bin.index.json')):
      raise ConvertError(f'{self.directory} holds pytorch_model.bin but no {SINGLE_FILE}: only '
                         f'safetensors are read; convert it with transformers: '
                         f'AutoModelForCausalLM.from_pretrained(dir).save_pretrained(new_dir)')
    else:
      raise ConvertError(f'{self.directory} has neither {SINGLE_FILE} nor {INDEX_FILE} (sharded); '
                         f'only safetensors checkpoints are read')
    files, shapes = {}, {}
    for path in paths:
      try:
        with safe_open(path, framework='numpy') as f:
          for name in f.keys():
            files[name] = path
            shapes[name] = _shape(f.get_slice(name).get_shape())
      except (OSError, SafetensorError) as e:
        raise ConvertError(f'{path} is not a readable safetensors file ({e})') from None
    return files, shapes

  def _expected(self) -> set[str]:
    return {name for link in self._links.values() for name in link.hf_names(self._cfg.num_layers)}

  def _check_nothing_unmapped(self) -> None:
    """A tensor nothing maps to means an option we do not implement (e.g. a bias config.json does
    not announce); loading around it would compute something else, so it is refused."""
    expected = self._expected()
    extra = sorted(n for n in self._shapes
                   if n not in expected and not ignored(self.arch, n, self._cfg.tie_embeddings))
    if extra:
      more = f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''
      raise ConvertError(f'{self._files[extra[0]]}: tensor {extra[0]!r}{more} matches no parameter '
                         f'of the {self.arch} model {self._config_path} describes')

  def _check_tensor(self, name: str, link: Link) -> None:
    if name not in self._shapes:
      raise ConvertError(f'tensor {name!r} is missing from the safetensors files in '
                         f'{self.directory}')
    if self._shapes[name] != link.hf_shape:
      raise ConvertError(f'tensor {name!r} in {self._files[name]} has shape {self._shapes[name]}; '
                         f'{self._config_path} expects {link.hf_shape}')

  # ---- parameters ----------------------------------------------------------------------------
  def _link(self, path: tuple[str, ...], shape: tuple[int, ...]) -> Link:
    """The link for our parameter at `path`, after every check that needs no tensor data."""
    link = self._links.get(path)
    if link is None:
      known = ', '.join('/'.join(p) for p in self._links)
      raise ConvertError(f'{"/".join(map(str, path))} has no tensor in a {self.arch} checkpoint; '
                         f'its parameters: {known}')
    expected = link.our_shape(self._cfg.num_layers)
    if shape != expected:
      raise ConvertError(f'{"/".join(path)} was asked for with shape {shape}; {self._config_path} '
                         f'gives {expected} (build the model from HFCheckpoint.model_fields())')
    for name in link.hf_names(self._cfg.num_layers):
      self._check_tensor(name, link)
    return link

  def check(self, path: tuple[str, ...], shape: tuple) -> None:
    """ConvertError unless our parameter at `path` has `shape` and its tensors are in the files
    with the shapes config.json implies (headers only: no tensor data is read)."""
    self._link(tuple(path), _shape(shape))

  def read(self, path: tuple[str, ...], shape: tuple, dtype) -> np.ndarray:
    """Our parameter at `path` (e.g. ('blocks', 'attention', 'query', 'kernel')), in our layout and
    `dtype`; a stacked parameter reads each layer's tensor into one [num_layers, ...] array."""
    path, shape = tuple(path), _shape(shape)
    link = self._link(path, shape)
    out = np.empty(shape, np.dtype(dtype))
    with contextlib.ExitStack() as stack:
      handles = {}
      for i, name in enumerate(link.hf_names(self._cfg.num_layers)):
        file = self._files[name]
        if file not in handles:
          handles[file] = stack.enter_context(safe_open(file, framework='numpy'))
        layer = link.to_ours(handles[file].get_slice(name)[link.part_index])
        if link.stacked:
          out[i] = layer
        else:
          out[...] = layer
    return out

  def read_all(self, template: dict) -> dict:
    """The same nested dict as `template` (arrays or ShapeDtypeStructs: our parameter tree), read.
    Every parameter is checked before any is read, and the template must hold every tensor the
    checkpoint has (a missing one, e.g. an untied head, would change what the model computes)."""
    leaves = traverse_util.flatten_dict(template)
    missing = [link for path, link in self._links.items() if path not in leaves]
    if missing:
      raise ConvertError(f'the template has no {"/".join(missing[0].path)}, which this checkpoint '
                         f'holds ({missing[0].hf_names(self._cfg.num_layers)[0]}); build the model '
                         f'from HFCheckpoint.model_fields()')
    for path, leaf in leaves.items():
      self._link(tuple(path), _shape(leaf.shape))
    return traverse_util.unflatten_dict(
        {path: self.read(path, leaf.shape, leaf.dtype) for path, leaf in leaves.items()})
