"""Precision policies (which dtype weights are stored in, which dtype the math runs in) and fp16
dynamic loss scaling."""
