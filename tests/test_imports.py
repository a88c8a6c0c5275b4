"""train/imports.py: flax.nnx and tensorboardX come without the packages they only probe for, give
the answers those probes give in a process that is not a notebook, and leave those packages
importable afterwards."""
import os
import subprocess
import sys

from tests.helpers import child_environ

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A blocked package is a None in sys.modules while the import runs; its name still there afterwards
# (imported, or None) would fail the first line.
_PROBE = """
import sys
from train import imports
imports.flax_nnx()
imports.tensorboardx()
print('in sys.modules', sorted(m for m in ('IPython', 'torch') if m in sys.modules))
from flax.nnx import reprlib, summary, visualization
print('in a notebook', summary.in_ipython or visualization.in_ipython)
"""


def test_flax_and_tensorboardx_come_without_ipython_or_torch_and_leave_them_importable():
  out = subprocess.run([sys.executable, '-c', _PROBE], cwd=ROOT, env=child_environ(),
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-2000:]
  assert out.stdout.splitlines() == ['in sys.modules []', 'in a notebook False'], out.stdout
