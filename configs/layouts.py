"""The parallel layouts: each is a mesh shape plus a ZeRO stage (and, for a pipeline, its
schedule) on top of the default experiment.

With no accelerator, a layout config simulates 8 CPU devices (`host_devices`), so every layout
runs as a real sharded program on a laptop; on GPUs the mesh takes the real devices.
"""
import ml_collections

from configs import default


def _mesh(stage=1, data=1, fsdp=1, context=1, tensor=1) -> dict:
  return dict(stage=stage, data=data, fsdp=fsdp, context=context, tensor=tensor)


LAYOUTS = {
    # name: (dotted-key settings, what it is)
    'ddp': ({'mesh': _mesh(data=-1), 'parallel.zero_stage': 0},
            'data parallel: everything replicated'),
    'zero1': ({'mesh': _mesh(fsdp=-1), 'parallel.zero_stage': 1},
              'ZeRO-1: optimizer state sharded'),
    'zero2': ({'mesh': _mesh(fsdp=-1), 'parallel.zero_stage': 2},
              'ZeRO-2: optimizer state and gradients sharded'),
    'fsdp': ({'mesh': _mesh(fsdp=-1), 'parallel.zero_stage': 3},
             'ZeRO-3 / FSDP: parameters sharded too'),
    'tp': ({'mesh': _mesh(data=-1, tensor=4), 'parallel.zero_stage': 0},
           'tensor parallel (4-way, Megatron) x data parallel'),
    'fsdp_tp': ({'mesh': _mesh(fsdp=-1, tensor=2), 'parallel.zero_stage': 3},
                'FSDP x 2-way tensor parallel'),
    'pipeline': ({'mesh': _mesh(stage=4, fsdp=-1), 'parallel.zero_stage': 3,
                  'parallel.pipeline_schedule': 'gpipe', 'parallel.pipeline_microbatches': 4},
                 'GPipe over 4 stages (4 microbatches), FSDP inside each stage'),
}


def layout_config(layout: str, preset: str | None) -> ml_collections.ConfigDict:
  overrides, description = LAYOUTS[layout]
  return default.variant(layout, preset, {**overrides, 'host_devices': 8}, description)
