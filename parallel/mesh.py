"""The device mesh from `config.mesh` (axis name -> size; one -1 takes the devices left over)."""
import math

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

# Outermost first: pipeline stages cross the slowest links (between nodes), tensor the fastest;
# context (the sequence split, models/context.py) gathers keys and values in every layer, so it
# sits next to tensor.
MESH_AXES = ('stage', 'data', 'fsdp', 'context', 'tensor')


def resolve_mesh_shape(mesh_config: dict, num_devices: int) -> dict[str, int]:
  """Sizes for every mesh axis, in MESH_AXES order; raises ValueError naming the bad value."""
  sizes = dict(mesh_config)
  unknown = sorted(set(sizes) - set(MESH_AXES))
  if unknown:
    raise ValueError(f'mesh axis {unknown[0]!r} is not known; allowed: {", ".join(MESH_AXES)}')
  for name, size in sizes.items():
    if not isinstance(size, int) or (size < 1 and size != -1):
      raise ValueError(f'mesh.{name}={size!r}; a mesh size is a positive integer or -1 (the rest)')
  free = [name for name, size in sizes.items() if size == -1]
  if len(free) > 1:
    raise ValueError(f'mesh has -1 on {free}; at most one axis may take the rest')
  fixed = math.prod(size for size in sizes.values() if size != -1)
  if free:
    if num_devices % fixed:
      raise ValueError(f'mesh {sizes} cannot fill {num_devices} devices: the fixed axes multiply to '
                       f'{fixed}, which does not divide {num_devices}')
    sizes[free[0]] = num_devices // fixed
  if math.prod(sizes.values()) != num_devices:
    raise ValueError(f'mesh {sizes} has {math.prod(sizes.values())} devices but {num_devices} are '
                     f'available; make the sizes multiply to {num_devices} or use -1 on one axis')
  return {name: sizes.get(name, 1) for name in MESH_AXES}


def make_mesh(mesh_config: dict, devices=None) -> Mesh:
  devices = list(jax.devices() if devices is None else devices)
  shape = resolve_mesh_shape(mesh_config, len(devices))
  # Auto axes: the compiler chooses collectives for FSDP/TP patterns that Explicit axes reject.
  if devices == list(jax.devices()):
    return jax.make_mesh(tuple(shape.values()), tuple(shape), axis_types=(AxisType.Auto,) * len(shape))
  grid = np.asarray(devices).reshape(tuple(shape.values()))
  return Mesh(grid, tuple(shape), axis_types=(AxisType.Auto,) * len(shape))


def data_parallel_size(mesh: Mesh) -> int:
  """How many ways the batch is split (the axes that `batch` maps to)."""
  return mesh.shape['data'] * mesh.shape['fsdp']
