"""Devices of GPUs that are not here: the CUDA plugin's compile-only topology. A step jitted for
them and compiled (`.lower(...).compile()`) runs XLA:GPU's whole pipeline (fusion, scheduling,
buffer assignment) on this machine's CPU, so its memory analysis is the GPU's own, before a GPU
is rented. What JAX runs eagerly (shapes, the batch's placeholders) stays on the CPU.

`prepare` must run before JAX starts a backend; `compile_devices` after it. The plugin is the CUDA
plugin of the installed jax (requirements-gpu-compile.txt); no driver and no GPU are needed."""
import importlib.metadata
import os

from parallel import xla_flags

REQUIREMENTS = 'requirements-gpu-compile.txt'
# Nothing to autotune without a device: XLA's sharded autotuning would wait for peers that are
# not there. Nor is the machine code ever run, so ptxas (started once per kernel: 165 times for a
# 100m step, 23 % of that test's CPU time) runs at -O0; the HLO, its buffers and the memory
# analysis are the same byte for byte (WORKSPACE, 2026-12-02).
DEVICELESS_FLAGS = (('xla_gpu_shard_autotuning', 'false'),
                    ('xla_gpu_disable_gpuasm_optimizations', 'true'))


# Each compile-only device's memory in bytes, as its description gives it (`device_memory`): the
# devices themselves report none. Keyed by the device (kept alive here, as its topology keeps it).
_MEMORY: dict = {}


class TargetCompileError(RuntimeError):
  pass


def plugin() -> str | None:
  """The installed CUDA plugin's module (None: none is): what compiles for a target."""
  return xla_flags.cuda_plugin()


def prepare(environ=os.environ) -> list[str]:
  """Set before any backend starts: JAX on the CPU (the GPUs are compile-only devices), the
  plugin's check of a driver skipped, and XLA's flags for a GPU training run (what a run on the
  target gets: parallel/xla_flags.py; they change scheduling, hence memory) with sharded
  autotuning off. Raises TargetCompileError, naming the requirements file, where no CUDA plugin is
  installed. Returns the XLA flags added."""
  if plugin() is None:
    raise TargetCompileError(
        f'--target compiles for the GPU with XLA:GPU, which needs the CUDA plugin of the installed '
        f'jax: pip install -r {REQUIREMENTS} (about 6 GB; no GPU or driver needed)')
  environ['JAX_PLATFORMS'] = 'cpu'
  environ['JAX_SKIP_CUDA_CONSTRAINTS_CHECK'] = '1'
  value, added = xla_flags.merged(environ.get('XLA_FLAGS', ''),
                                  xla_flags.GPU_TRAINING_FLAGS + DEVICELESS_FLAGS)
  environ['XLA_FLAGS'] = value
  return added


def _version(packages: tuple[str, ...], parts: int) -> tuple | None:
  for package in packages:
    try:
      numbers = importlib.metadata.version(package).split('.')
    except importlib.metadata.PackageNotFoundError:
      continue
    return tuple(int(n) for n in numbers[:parts])
  return None


def library_versions() -> dict:
  """The cuDNN and CUDA runtime versions a run of this installation loads (the pip packages the
  CUDA plugin brought; XLA chooses kernels, the cuDNN attention's among them, by them): those
  found, as `cudnn` (major, minor, patch) and `cuda_runtime` (major, minor)."""
  found = {'cudnn': _version(('nvidia-cudnn-cu13', 'nvidia-cudnn-cu12'), 3),
           'cuda_runtime': _version(('nvidia-cuda-runtime', 'nvidia-cuda-runtime-cu13',
                                     'nvidia-cuda-runtime-cu12'), 2)}
  return {k: v for k, v in found.items() if v is not None}


def topology(count: int, per_node: int) -> str:
  """The plugin's topology string for `count` GPUs, `per_node` to a host: 1 x hosts x per host."""
  if count <= per_node:
    return f'1x1x{count}'
  if count % per_node:
    raise TargetCompileError(f'{count} GPUs do not fill nodes of {per_node}: compile for a '
                             f'multiple of {per_node}, or for {per_node} or fewer')
  return f'1x{count // per_node}x{per_node}'


def compile_devices(target_config: str, count: int, per_node: int, memory_bytes: int = 0) -> list:
  """`count` compile-only GPU devices described by `target_config` (a GpuTargetConfig text
  proto), `per_node` to a host, each of `memory_bytes` (its description's; 0: not known) as
  `device_memory` gives it. After `prepare`."""
  import jax
  from jax.experimental import topologies
  try:
    described = topologies.get_topology_desc(platform='cuda',
                                             topology=topology(count, per_node),
                                             target_config=target_config)
  except (jax.errors.JaxRuntimeError, RuntimeError, NotImplementedError) as e:
    if isinstance(e, TargetCompileError):
      raise
    raise TargetCompileError(f'the CUDA plugin could not describe {count} GPUs: '
                             f'{str(e).splitlines()[0]}') from None
  devices = list(described.devices)
  _MEMORY.update(dict.fromkeys(devices, memory_bytes))
  return devices


def device_memory(device) -> int:
  """Bytes of memory of `device`, a GPU here or compile-only; 0 where it is not known (a CPU, a
  description without it)."""
  if device.platform != 'gpu':
    return 0
  if device in _MEMORY:
    return _MEMORY[device]
  try:
    return int((device.memory_stats() or {}).get('bytes_limit', 0))
  except Exception:   # noqa: BLE001 - jaxlib raises its own runtime errors where stats are missing
    return 0
