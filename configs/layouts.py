"""The parallel layouts: each is a mesh shape plus a ZeRO stage on top of the default experiment.

With no accelerator, a layout config simulates 8 CPU devices (`host_devices`), so every layout
runs as a real sharded program on a laptop; on GPUs the mesh takes the real devices.
"""
import ml_collections

from configs import default

LAYOUTS = {
    # name: (mesh, zero_stage, what it is)
    'ddp': (dict(data=-1, fsdp=1, tensor=1), 0, 'data parallel: everything replicated'),
    'zero1': (dict(data=1, fsdp=-1, tensor=1), 1, 'ZeRO-1: optimizer state sharded'),
    'zero2': (dict(data=1, fsdp=-1, tensor=1), 2, 'ZeRO-2: optimizer state and gradients sharded'),
    'fsdp': (dict(data=1, fsdp=-1, tensor=1), 3, 'ZeRO-3 / FSDP: parameters sharded too'),
    'tp': (dict(data=-1, fsdp=1, tensor=4), 0, 'tensor parallel (4-way, Megatron) x data parallel'),
    'fsdp_tp': (dict(data=1, fsdp=-1, tensor=2), 3, 'FSDP x 2-way tensor parallel'),
}


def layout_config(layout: str, preset: str | None) -> ml_collections.ConfigDict:
  mesh, zero_stage, description = LAYOUTS[layout]
  return default.variant(layout, preset, {'mesh': mesh, 'parallel.zero_stage': zero_stage,
                                          'host_devices': 8}, description)
