"""Experiment configs: one file per experiment, each `get_config(arg)` -> ml_collections.ConfigDict."""
import importlib.util


def load(spec: str):
  """The config a `path[:arg]` names (`configs/fsdp.py:7b`), before any override."""
  path, _, arg = spec.partition(':')
  module_spec = importlib.util.spec_from_file_location('_config_file', path)
  module = importlib.util.module_from_spec(module_spec)
  module_spec.loader.exec_module(module)
  return module.get_config(arg) if arg else module.get_config()
