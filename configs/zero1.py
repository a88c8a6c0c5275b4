"""ZeRO-1: optimizer state sharded.

  python main.py --config=configs/zero1.py            # the small model on 8 simulated CPU devices
  python main.py --config=configs/zero1.py:7b --dry_run   # per-device memory of a 7B train step
"""
from configs.layouts import layout_config


def get_config(preset: str | None = None):
  return layout_config('zero1', preset)
