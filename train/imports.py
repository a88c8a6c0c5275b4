"""Third-party imports without the optional packages they probe for and a training process never
uses: each such probe imports a large package (seconds of a process's start) to answer a question
whose answer is already known. A package already imported is left as it is, so what the library
then does is what it would have done."""
import importlib
import sys


def without(module: str, absent: str):
  """`module`, imported while `absent` cannot be (its `import` raises ImportError, which every
  probe below allows), unless `absent` is imported already."""
  if absent in sys.modules:
    return importlib.import_module(module)
  sys.modules[absent] = None
  try:
    return importlib.import_module(module)
  finally:
    del sys.modules[absent]


def tensorboardx(module: str = 'tensorboardX'):
  """tensorboardX (or one of its modules) without torch: where torch is installed, tensorboardX
  imports it only to accept its tensors (3 s of every run's start on a 2-core machine, `python -X
  importtime -c "import train.run"`), and we log Python floats."""
  return without(module, 'torch')


def flax_nnx():
  """flax.nnx without IPython: where IPython is installed, three of flax.nnx's modules import it
  to ask whether they run in a notebook (`get_ipython() is not None`), 0.4-0.6 s of a process's
  start. A notebook has imported IPython already, and a process that has not is not one: the
  answer is no either way. Call before anything imports flax (main.py, cli/)."""
  return without('flax.nnx', 'IPython')
