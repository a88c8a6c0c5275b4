"""Per-device memory of a compiled program, from XLA's memory analysis (no allocation needed)."""
GiB = 2.0**30


def format_bytes(n: float) -> str:
  """Always GiB, with enough decimals that small figures still read."""
  return f'{n / GiB:,.2f} GiB' if n >= GiB else f'{n / GiB:.4f} GiB'


def compiled_memory(compiled) -> dict:
  """arguments, outputs, aliased (donated), temp and total bytes on one device.

  total = arguments + outputs - aliased + temp: donated inputs share their buffers with the
  outputs, so they count once."""
  stats = compiled.memory_analysis()
  arguments = int(stats.argument_size_in_bytes)
  outputs = int(stats.output_size_in_bytes)
  aliased = int(stats.alias_size_in_bytes)
  temp = int(stats.temp_size_in_bytes)
  return {'arguments': arguments, 'outputs': outputs, 'aliased': aliased, 'temp': temp,
          'total': arguments + outputs - aliased + temp}


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
