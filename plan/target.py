"""`--target=<N>x<GPU>`: how many devices of which kind (configs/hardware.py), or `<N>x<M>GB`."""
import dataclasses
import re

from configs.hardware import GB, GPUS


class TargetError(ValueError):
  pass


@dataclasses.dataclass(frozen=True)
class Target:
  count: int
  name: str
  memory: float          # bytes per device
  peak_bf16: float       # FLOP/s
  peak_fp8: float | None  # FLOP/s (None: no fp8 tensor cores, or no figure)
  hbm: float             # bytes/s
  intra_node: float      # bytes/s per GPU per direction
  inter_node: float      # bytes/s per GPU
  per_node: int
  host_link: float       # bytes/s per GPU per direction to host memory
  host_memory: float     # bytes of host RAM per node

  def __str__(self):
    return f'{self.count}x{self.name}'


def parse_target(text: str) -> Target:
  match = re.fullmatch(r'(\d+)x(.+)', text or '')
  if not match or int(match.group(1)) < 1:
    raise TargetError(f'--target={text!r} is not <N>x<GPU>; e.g. 8xA100-80GB, 64xH100-80GB, '
                      f'1xRTX4090-24GB, or 8x48GB for a custom memory size')
  count, name = int(match.group(1)), match.group(2)
  if name in GPUS:
    return Target(count, name, **GPUS[name])
  custom = re.fullmatch(r'(\d+(?:\.\d+)?)GB', name)
  if custom:
    speeds = {k: v for k, v in GPUS['H100-80GB'].items() if k != 'memory'}
    return Target(count, name, memory=float(custom.group(1)) * GB, **speeds)
  raise TargetError(f'unknown GPU {name!r} in --target={text!r}; known: {", ".join(GPUS)} '
                    f'(or <M>GB for a custom memory size with H100 speeds)')


def description(target: Target):
  """The device XLA:GPU compiles for (configs/gpu_targets.py); a custom `<M>GB` target is an H100
  with M GB."""
  from configs.gpu_targets import DESCRIPTIONS
  if target.name in DESCRIPTIONS:
    return DESCRIPTIONS[target.name]
  return dataclasses.replace(DESCRIPTIONS['H100-80GB'], memory_bytes=int(target.memory))


def compile_devices(target: Target, target_config: str | None = None) -> list:
  """`target.count` compile-only devices of the target GPU, for XLA:GPU (after
  parallel.target.prepare), described by `target_config` (a GpuTargetConfig text proto; default
  the written description); TargetCompileError says why not."""
  from configs.gpu_targets import parse_text_proto
  from parallel.target import compile_devices as devices, library_versions
  text = target_config or description(target).target_config(**library_versions())
  memory = int(parse_text_proto(text).get('gpu_device_info.device_memory_size', 0))
  return devices(text, target.count, target.per_node, memory)
