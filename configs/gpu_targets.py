"""What XLA:GPU needs to know of a GPU to compile for it without one: the device description of
each GPU in configs/hardware.py, written out as the GpuTargetConfig text proto that the CUDA
plugin's compile-only topology takes (parallel/target.py), and read back to compare with a real
device's own (XLA's dump of it: `description_differences`). XLA's fusion, scheduling and buffer
assignment read these figures (the SM count, clock and bandwidth feed its cost model; the memory
size caps its scheduler), so a deviceless compile is the GPU's own program only where they are
the device's.

Sources, per GPU (compute capability, SMs, FP32 lanes per SM, boost clock, L2, shared memory per
SM and per block, memory): the CUDA C++ Programming Guide's table of technical specifications per
compute capability (threads, registers and shared memory: 8.0 has 164 KB of shared memory per SM
and 163 KB per block; 8.6 and 8.9 100 and 99 KB; 9.0 228 and 227 KB; 64 K registers per SM and
per block; 2,048 threads per SM on 8.0 and 9.0, 1,536 on 8.6 and 8.9), and
  A100-40GB/80GB  NVIDIA A100 Tensor Core GPU Architecture whitepaper: 108 SMs, 64 FP32 lanes per
                  SM, 1,410 MHz boost, 40 MB L2; memory as the A100 datasheet
  H100-80GB       NVIDIA H100 Tensor Core GPU Architecture whitepaper (H100 SXM5): 132 SMs, 128
                  FP32 lanes per SM, 50 MB L2; 1,980 MHz: the H100 SXM's maximum boost clock
                  (`nvidia-smi -q -d CLOCK` on one)
  H200-141GB      the H100 SXM's chip (NVIDIA H200 datasheet: same compute) with 141 GB HBM3e;
                  checked against a real H200's own description (XLA's dump of it, `python -m
                  bench.target_check`): it differed in the L2 (60 MB, not the H100's 50), the
                  memory (150,109,880,320 bytes) and the bandwidth (4.814 TB/s), now the device's
  GH200-96GB      the H100's chip (NVIDIA GH200 datasheet) with 96 GB HBM3 at 4 TB/s
  L40S-48GB       NVIDIA L40S datasheet: 142 SMs (18,176 CUDA cores), 2,520 MHz boost, 96 MB L2
  RTX4090-24GB    NVIDIA Ada Lovelace architecture whitepaper, appendix A: 128 SMs (16,384 CUDA
                  cores), 2,520 MHz boost, 72 MB L2
Memory sizes are what the device reports (`nvidia-smi`'s MiB, times 2**20), not the datasheet's
decimal GB: 81,559 MiB for an H100 80GB HBM3, 81,920 and 40,960 for the A100s, 46,068 for an
L40S, 24,564 for an RTX 4090, 97,871 for a GH200 (its HBM part). On the H200 XLA saw 615 MiB
less than `nvidia-smi`'s 143,771 MiB; the others keep `nvidia-smi`'s figure (not checked on one).
"""
import dataclasses
import re

from configs.hardware import GPUS

MiB = 2**20


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
  device_kind: str            # as jax names the device (jax.Device.device_kind)
  compute_capability: tuple   # (major, minor)
  sms: int                    # streaming multiprocessors ("cores" to XLA)
  fp32_lanes_per_sm: int
  clock_ghz: float            # boost clock
  l2_bytes: int
  shared_per_sm: int          # bytes of shared memory per SM
  shared_per_block_optin: int # the most one block may ask for
  memory_bytes: int           # as the device reports it
  bandwidth: float            # memory bytes/s (configs/hardware.py's hbm)
  threads_per_sm: int = 2048

  def target_config(self, cudnn: tuple = (9, 8, 0), cuda_runtime: tuple | None = None) -> str:
    """The GpuTargetConfig text proto; `cudnn` (major, minor, patch) and `cuda_runtime` (major,
    minor): the versions the compiled program will run with (XLA picks kernels by them), by
    default cuDNN 9.8, the first of jax 0.10's CUDA 12 line, and no runtime named."""
    major, minor = self.compute_capability
    info = dict(threads_per_block_limit=1024, threads_per_warp=32, shared_memory_per_block=48 * 1024,
                shared_memory_per_core=self.shared_per_sm, threads_per_core_limit=self.threads_per_sm,
                core_count=self.sms, fpus_per_core=self.fp32_lanes_per_sm,
                block_dim_limit_x=2**31 - 1, block_dim_limit_y=65535, block_dim_limit_z=65535,
                memory_bandwidth=int(self.bandwidth), l2_cache_size=self.l2_bytes,
                clock_rate_ghz=self.clock_ghz, device_memory_size=self.memory_bytes,
                shared_memory_per_block_optin=self.shared_per_block_optin,
                registers_per_core_limit=65536, registers_per_block_limit=65536)
    lines = ['gpu_device_info {', f'  cuda_compute_capability {{ major: {major} minor: {minor} }}']
    lines += [f'  {key}: {value}' for key, value in info.items()]
    lines += ['}', 'platform_name: "CUDA"',
              'dnn_version_info {{ major: {} minor: {} patch: {} }}'.format(*cudnn)]
    if cuda_runtime is not None:
      lines.append('runtime_version {{ major: {} minor: {} }}'.format(*cuda_runtime))
    lines.append(f'device_description_str: "{self.device_kind}"')
    return '\n'.join(lines) + '\n'


def _hopper(device_kind: str, name: str, memory_bytes: int, l2_mib: int = 50,
            bandwidth: float | None = None) -> DeviceDescription:
  return DeviceDescription(device_kind, (9, 0), sms=132, fp32_lanes_per_sm=128, clock_ghz=1.98,
                           l2_bytes=l2_mib * MiB, shared_per_sm=228 * 1024,
                           shared_per_block_optin=227 * 1024, memory_bytes=memory_bytes,
                           bandwidth=bandwidth or GPUS[name]['hbm'])


def _ampere(device_kind: str, name: str, mib: int) -> DeviceDescription:
  return DeviceDescription(device_kind, (8, 0), sms=108, fp32_lanes_per_sm=64, clock_ghz=1.41,
                           l2_bytes=40 * MiB, shared_per_sm=164 * 1024,
                           shared_per_block_optin=163 * 1024, memory_bytes=mib * MiB,
                           bandwidth=GPUS[name]['hbm'])


def _ada(device_kind: str, name: str, mib: int, sms: int, l2_mib: int) -> DeviceDescription:
  return DeviceDescription(device_kind, (8, 9), sms=sms, fp32_lanes_per_sm=128, clock_ghz=2.52,
                           l2_bytes=l2_mib * MiB, shared_per_sm=100 * 1024,
                           shared_per_block_optin=99 * 1024, memory_bytes=mib * MiB,
                           bandwidth=GPUS[name]['hbm'], threads_per_sm=1536)


DESCRIPTIONS = {   # configs/hardware.py's name -> the device
    'A100-40GB': _ampere('NVIDIA A100-SXM4-40GB', 'A100-40GB', 40960),
    'A100-80GB': _ampere('NVIDIA A100-SXM4-80GB', 'A100-80GB', 81920),
    'H100-80GB': _hopper('NVIDIA H100 80GB HBM3', 'H100-80GB', 81559 * MiB),
    # The device's own figures (bench/results/target-config-nvidia-h200.txtpb): 60 MB of L2 where
    # the H100 has 50, the memory XLA sees, and the bandwidth the CUDA driver computes.
    'H200-141GB': _hopper('NVIDIA H200', 'H200-141GB', 150_109_880_320, l2_mib=60,
                          bandwidth=4.814304e12),
    'GH200-96GB': _hopper('NVIDIA GH200 480GB', 'GH200-96GB', 97871 * MiB),
    'L40S-48GB': _ada('NVIDIA L40S', 'L40S-48GB', 46068, sms=142, l2_mib=96),
    'RTX4090-24GB': _ada('NVIDIA GeForce RTX 4090', 'RTX4090-24GB', 24564, sms=128, l2_mib=72),
}


def parse_text_proto(text: str) -> dict:
  """A text proto's scalar fields by dotted path (`gpu_device_info.core_count` -> '132')."""
  fields, path, name = {}, [], None
  for token in re.findall(r'"[^"]*"|[{}]|[^\s{}:"]+:?', re.sub(r'(?m)^\s*#.*$', '', text)):
    if token == '{':
      path.append(name)
      name = None
    elif token == '}':
      path.pop()
    elif name is None:
      name = token.rstrip(':')
    else:
      fields['.'.join(path + [name])] = token.strip('"')
      name = None
  return fields


def description_differences(written: str, dumped: str) -> list[dict]:
  """The fields of the written description where the device's own (XLA's dump of it) differs. A
  field the dump leaves out holds the proto's default (0); newer XLA writes the cuDNN version as
  `gpu_device_info.dnn_version` rather than `dnn_version_info`."""
  ours, device = parse_text_proto(written), parse_text_proto(dumped)
  dnn = device.get('gpu_device_info.dnn_version')
  if dnn and not any(k.startswith('dnn_version_info.') for k in device):
    device.update(zip(('dnn_version_info.major', 'dnn_version_info.minor',
                       'dnn_version_info.patch'), dnn.split('.')))
  out = []
  for key, value in ours.items():
    theirs = device.get(key, '0')
    same = value == theirs
    try:
      same = same or float(value) == float(theirs)
    except ValueError:
      pass
    if not same:
      out.append({'field': key, 'written': value, 'device': theirs})
  return out
