"""Per-device memory of a compiled program, from XLA's memory analysis (no allocation needed), its
device and host memory apart."""
import re

from parallel.hlo_arrays import arrays as hlo_arrays

GiB = 2.0**30
HOST_MEMORY_SPACE = 'S(5)'   # XLA's layout tag of a buffer in (pinned) host memory


def compiler_of(platform: str) -> str:
  """The compiler a platform's programs are compiled by: `XLA:GPU`, `XLA:CPU`."""
  return f'XLA:{"GPU" if platform == "gpu" else platform.upper()}'


def format_bytes(n: float) -> str:
  """Always GiB, with enough decimals that small figures still read."""
  return f'{n / GiB:,.2f} GiB' if n >= GiB else f'{n / GiB:.4f} GiB'


def _sizes(arguments, outputs, aliased, temp) -> dict:
  """total = arguments + outputs - aliased + temp: donated inputs share their buffers with the
  outputs, so they count once."""
  return {'arguments': arguments, 'outputs': outputs, 'aliased': aliased, 'temp': temp,
          'total': arguments + outputs - aliased + temp}


def compiled_memory(compiled) -> dict:
  """arguments, outputs, aliased (donated), temp and total bytes in one device's memory."""
  return compiled_memory_spaces(compiled)[0]


def compiled_memory_spaces(compiled, hlo_text: str | None = None) -> tuple[dict, dict]:
  """(bytes in one device's memory, bytes in host memory for that device), each as arguments,
  outputs, aliased, temp and total. XLA on GPU reports host bytes itself; XLA:CPU counts them with
  the device's, so there they are read off the program's parameter and result layouts (a host
  buffer's layout carries memory space 5) and taken out of the device's figures. `hlo_text`:
  `compiled.as_text()` where the caller has it already."""
  stats = compiled.memory_analysis()
  device = [int(stats.argument_size_in_bytes), int(stats.output_size_in_bytes),
            int(stats.alias_size_in_bytes), int(stats.temp_size_in_bytes)]
  host = [int(getattr(stats, f'host_{k}_size_in_bytes', 0))
          for k in ('argument', 'output', 'alias', 'temp')]
  if not any(host):
    host = host_edge_bytes(hlo_text if hlo_text is not None else compiled.as_text()) + [0]
    device = [d - h for d, h in zip(device, host + [0])]
  return _sizes(*device), _sizes(*host)


def host_edge_bytes(hlo_text: str) -> list[int]:
  """[arguments, outputs, aliased] bytes in host memory at the compiled program's edge (per
  device: the entry layout has per-device shapes)."""
  header = hlo_text.split('\n', 1)[0]
  layout = re.search(r'entry_computation_layout=\{\((.*)\)->(.*)\}', header)
  if layout is None:
    return [0, 0, 0]

  def arrays(part):
    return [(size, HOST_MEMORY_SPACE in layout) for size, layout in hlo_arrays(part)]
  params, results = arrays(layout.group(1)), arrays(layout.group(2))
  aliases = re.search(r'input_output_alias=\{(.*?)\}\s*,\s*entry', header)
  aliased = 0
  for _, param in re.findall(r'\{(\d*)\}:\s*\((\d+),', aliases.group(1) if aliases else ''):
    size, on_host = params[int(param)]
    aliased += size if on_host else 0
  return [sum(b for b, h in params if h), sum(b for b, h in results if h), aliased]


def _device_stat(name: str) -> int | None:
  import jax
  stats = jax.local_devices()[0].memory_stats()
  return int(stats[name]) if stats and name in stats else None


def peak_device_memory() -> int | None:
  """Peak bytes in use on the first local device, where the backend reports it (GPUs, not CPUs)."""
  return _device_stat('peak_bytes_in_use')


def device_memory_limit() -> int | None:
  """The bytes the first local device's allocator may use (XLA_PYTHON_CLIENT_MEM_FRACTION of the
  device), where the backend reports it."""
  return _device_stat('bytes_limit')
