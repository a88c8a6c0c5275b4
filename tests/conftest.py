"""Test session set-up: 8 simulated CPU devices, so multi-device layouts run on any machine; and
JAX's persistent compilation cache in a directory of the suite's own, shared by every `main.py` the
suite starts (JAX_COMPILATION_CACHE_DIR, which `configs/default.py` takes as the default
`compile_cache`), removed when the suite ends. So no run of the suite writes to the user's cache or
reads from it, and a program that several runs compile alike (the tiny preset's one-device train
step, under many guides) is compiled once. A cached program is the compiled program itself, looked
up by its HLO, options and devices: what a test computes does not depend on which run compiled it
first. The cache serves what it serves a user (train/compile_cache.py:unserved): not the workers'
own programs, which run on 8 XLA:CPU devices, nor a `main.py` over several; a worker keeps
those itself, in memory, for the tests after (tests/compile_memo.py). XLA:GPU's kernels for the
GPUs that are not here are kept in a file of each worker's own, removed when it ends. Programs
compile at XLA's optimization level 0, the LLVM module unsplit (tests/helpers.py:QUICK_COMPILE
says why).

The flags must be set before JAX initialises its backends, which is why they live here.
"""
import os
import shutil
import tempfile

import pytest


os.environ.setdefault("JAX_PLATFORMS", "cpu")   # read when jax is imported, as the next switch is
os.environ.pop("JAX_ENABLE_COMPILATION_CACHE", None)   # JAX's own switch: on

import jax  # noqa: E402  (after the two above)
from tests.helpers import QUICK_COMPILE  # noqa: E402
from parallel import xla_flags  # noqa: E402
from parallel.target import DEVICELESS_FLAGS  # noqa: E402
from tests import compile_memo  # noqa: E402

os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {QUICK_COMPILE}")
# A step compiled here for GPUs that are not here is scheduled with the flags a run on the target
# gets (what `--target` sets: parallel/target.py:prepare); XLA:CPU reads none of them.
os.environ["XLA_FLAGS"] = xla_flags.merged(os.environ["XLA_FLAGS"],
                                           xla_flags.GPU_TRAINING_FLAGS + DEVICELESS_FLAGS)[0]
compile_memo.install()   # a program compiled again in this process is the one compiled before
# XLA:GPU's kernels, compiled for the GPUs that are not here, kept in a file of this process's own
# and looked up by each later compile, which then skips their LLVM and ptxas passes
# (tests/test_target.py, `-n 2`: 133 -> 105 s). Only machine code, which nothing here runs, comes
# from it; the HLO, its buffers and the memory analysis are the same byte for byte.
# XLA reads its flags once, when the first backend starts: the processes a test starts, which
# inherit the environment, do not get this process's file (two writers would tear it).
GPU_KERNEL_CACHE = os.path.join(tempfile.gettempdir(), f"lmlm-suite-gpu-kernels-{os.getpid()}.bin")
# jaxlib 0.10 writes the cache only with the LLVM module's parallel compile on; XLA took that flag
# out in 0.11, where an unknown flag stops the process.
_KERNEL_CACHE_FLAGS = (("xla_gpu_kernel_cache_file", GPU_KERNEL_CACHE),) + (
    (("xla_gpu_enable_llvm_module_compilation_parallelism", "true"),)
    if jax.__version_info__ < (0, 11) else ())
_children_flags = os.environ["XLA_FLAGS"]
os.environ["XLA_FLAGS"] = xla_flags.merged(_children_flags, _KERNEL_CACHE_FLAGS)[0]
jax.devices()
os.environ["XLA_FLAGS"] = _children_flags


def pytest_configure(config):
  """The controller (or a run without workers) makes the suite's cache; the workers, started
  after this, inherit its path through the environment (a worker that did not makes its own)."""
  if not hasattr(config, "workerinput") or "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="lmlm-suite-jax-cache-")
    config.suite_cache = os.environ["JAX_COMPILATION_CACHE_DIR"]
  from train import compile_cache
  compile_cache.enable(os.environ["JAX_COMPILATION_CACHE_DIR"],
                       off_because=compile_cache.unserved())


@pytest.hookimpl(optionalhook=True)   # xdist's hook: known where xdist is installed
def pytest_xdist_make_scheduler(config, log):
  """Work stealing that hands tests over at a file's edge (tests/scheduling.py says why)."""
  if config.getvalue("dist") == "worksteal":
    from tests.scheduling import FileEdgeStealing
    return FileEdgeStealing(config, log)
  return None


def pytest_unconfigure(config):
  if hasattr(config, "suite_cache"):
    shutil.rmtree(config.suite_cache, ignore_errors=True)
  if os.path.exists(GPU_KERNEL_CACHE):
    os.remove(GPU_KERNEL_CACHE)


def pytest_collection_finish(session):
  """Every test module is imported: what is alive now lives as long as the process, so the garbage
  collector stops walking it (train/collector.py; the suite's tests trace and compile hundreds of
  programs a process)."""
  from train import collector
  collector.settle()
