"""Tensor parallel (4-way, Megatron) x data parallel.

  python main.py --config=configs/tp.py            # the small model on 8 simulated CPU devices
  python main.py --config=configs/tp.py:7b --dry_run   # per-device memory of a 7B train step
"""
from configs.layouts import layout_config


def get_config(preset: str | None = None):
  return layout_config('tp', preset)
