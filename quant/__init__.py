"""Number formats and quantized products: int8/int4/fp8/NF4 formats and their scaling, the
quantized matmuls (Qwix's QT, LSQ, fp8 delayed scaling, LLM.int8()), weight-only quantized storage.
No model classes: the dense layer that runs these products is models/dense.py."""
