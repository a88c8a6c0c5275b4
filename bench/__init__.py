"""Benchmarks and the tools that read what a run or a compile did (`python -m bench.<name>`).

Where the CUDA plugin is installed but no GPU is here (requirements-test.txt brings the plugin, for
`--target` compiles), JAX would try the GPU first and print a traceback before falling back to the
CPU: every benchmark starts on the CPU there instead, unless JAX_PLATFORMS says otherwise."""
import os

from parallel.xla_flags import cuda_plugin_without_gpu

if cuda_plugin_without_gpu():
  os.environ.setdefault('JAX_PLATFORMS', 'cpu')
