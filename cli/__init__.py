"""The programs a user types besides `main.py`, each a thin command line over the library in
`train/` (which defines no flags, so anything may import it):

  python -m cli.evaluate   --workdir=W ...   score a run's newest checkpoint (train/evaluate.py)
  python -m cli.generate   --workdir=W ...   sample text from a run (train/generate.py)
  python -m cli.export_hf  --workdir=W ...   write a run as a Hugging Face checkpoint (train/export_hf.py)

The old names (`python -m train.evaluate`, `train.generate`, `train.export_hf`) still run these.
"""
from train import imports

imports.flax_nnx()   # before the program imports it: without IPython's import
