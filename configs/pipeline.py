"""Pipeline parallelism: the layers split over 4 stages (GPipe, 4 microbatches), FSDP inside each.

  python main.py --config=configs/pipeline.py            # the small model on 8 simulated CPU devices
  python main.py --config=configs/pipeline.py --config.parallel.pipeline_schedule=circular \
      --config.parallel.pipeline_repeats=2 --config.model.num_layers=8   # interleaved, 2 chunks per stage
  python main.py --config=configs/pipeline.py:70b --dry_run --host_devices=64 \
      --config.mesh.stage=8 --config.parallel.pipeline_microbatches=8   # 70B: 8 stages x 8-way FSDP
"""
from configs.layouts import layout_config


def get_config(preset: str | None = None):
  return layout_config('pipeline', preset)
