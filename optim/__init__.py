"""Optimizers: AdamW assembly with its schedule and clipping, 8-bit blockwise Adam, the weight-decay
mask."""
