"""Small configs and models shared by the tests, and the environment of a process a test starts."""
import os
import sys

import jax
import numpy as np
from flax import nnx

from configs import default
from models import ModelConfig
from precision.policy import get_policy
from train.state import build_model


# Compiling is half of the suite's time (JAX's compile events, summed over its processes), and
# three XLA:CPU switches make a small program's compile quicker:
# - level 0: LLVM's optimisation of the machine code, most of a compile, saves little when it runs
#   (tests/test_train_step.py took 34.5 s instead of 57.0 s, `-n 2`, 2-core AVX2 machine);
# - where the jaxlib still has them (0.10; XLA removed them in 0.11), the elemental emitters
#   instead of the MLIR fusion emitters (the tiny fsdp step at level 0: 1.41 -> 0.56 s; the
#   same file: 24.4 s);
# - the LLVM module compiled whole, not split into 32 parts for as many threads: on 2 cores that
#   two workers share, the split and its 32 compiles cost more than they run in parallel
#   (tests/test_layouts.py and test_train_step.py, `-n 2`, jax 0.10.2: 68.4 and 69.8 s of CPU ->
#   62.7 and 61.5; 137 s either way on 0.11.2; the same losses, memory figures and sample, bit
#   for bit, from the tiny fsdp run).
# The HLO, its fusion and its buffers are XLA's own either way (the buffers of a step differ by a
# few hundred bytes of temporaries; figures compared byte for byte are compiled with a user's
# flags, tests/test_figures.py); only the machine code is less tuned, so every tolerance (from the
# format, not from a run) still holds.
_LEGACY_EMITTERS = jax.__version_info__ < (0, 11)
QUICK_COMPILE = ('--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1'
                 + (' --xla_cpu_use_fusion_emitters=false' if _LEGACY_EMITTERS else ''))


def child_environ(xla_flags: str = '', **extra) -> dict:
  """The suite's environment for a process a test starts, with XLA_FLAGS set to `xla_flags` and
  the quick compile only: the child sets its own device count (main.py's --host_devices)."""
  return {**os.environ, 'XLA_FLAGS': f'{xla_flags} {QUICK_COMPILE}'.strip(), **extra}


def python(env: dict | None = None) -> list[str]:
  """The words that start `python ...` for a process a test starts in `env` (child_environ()'s
  by default): the warm Python's client (tests/warm_python.py), which skips the imports every such
  process begins with, or a new interpreter where SUITE_WARM_PYTHON=0. A test that kills its
  process with SIGKILL, or asks what a new interpreter has imported, starts `sys.executable`."""
  from tests import warm_python
  if not warm_python.ENABLED:
    return [sys.executable]
  return warm_python.command(child_environ() if env is None else env)


def tiny_config(**overrides):
  """The tiny preset with `a.b=value` style overrides, e.g. tiny_config(**{'train.steps': 3})."""
  config = default.get_config('tiny')
  for key, value in overrides.items():
    default.override(config, key, value)
  return config


def tiny_model_config(**model_overrides) -> ModelConfig:
  return ModelConfig.from_config({**tiny_config().model.to_dict(), **model_overrides})


def tiny_model(precision: str = 'fp32', seed: int = 0, **model_overrides):
  cfg = tiny_model_config(**model_overrides)
  return cfg, build_model(cfg, get_policy(precision), seed)


def random_tokens(shape, seed: int = 0) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, 256, size=shape, dtype=np.int32)


def split_params(model):
  graphdef, params = nnx.split(model, nnx.Param)
  return graphdef, nnx.to_pure_dict(params)


def tree_allclose(a, b, **tol) -> bool:
  return all(np.allclose(x, y, **tol) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def reordered_rtol(n: int) -> float:
  """Relative tolerance between two fp32 sums (or means) of the same n terms of one sign, added in
  different orders (another layout, another split into microbatches): each is within
  gamma_n ~ n 2**-24 of the exact sum (n roundings of at most half an ulp), so twice that apart."""
  return 2 * n * 2.0 ** -24


def checkpoint_round_trip(state, step: int, abstract, directory: str):
  """`state` saved at `step` in a fresh checkpoint directory and restored onto `abstract` (another
  layout's): (the restored state, `state` as numpy arrays before the save)."""
  from train.checkpoint import Checkpointer
  saved = jax.tree.map(np.asarray, jax.device_get(state))
  checkpoints = Checkpointer(directory, keep=1)
  checkpoints.save(step, state, {}, {})
  checkpoints.wait()
  restored, _ = checkpoints.restore(step, abstract)
  checkpoints.close()
  return restored, saved
