"""`python -m cli.export_hf`: writes a run of ours as a Hugging Face checkpoint (safetensors +
config.json) that `transformers` loads with `from_pretrained`, adapters merged
(train/export_hf.py).

  python -m cli.export_hf --workdir=runs/my-run --out=exported/ [--dtype=bfloat16] [--step=N]
"""
import os
import sys

from absl import app, flags, logging

from train import checks
from train.checkpoint import CheckpointError
from train.export_hf import export_run

_WORKDIR = flags.DEFINE_string('workdir', None, 'The run to export (its config.json and checkpoints/).')
_OUT = flags.DEFINE_string('out', None, 'A new directory for the Hugging Face checkpoint.')
_DTYPE = flags.DEFINE_enum('dtype', 'float32', ['float32', 'bfloat16', 'float16'],
                           'The dtype of the exported tensors.')
_STEP = flags.DEFINE_integer('step', None, 'The checkpoint step; default the latest.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)   # orbax narrates every restore at INFO
  from convert import ConvertError
  if not _WORKDIR.value or not _OUT.value:
    sys.exit('error: --workdir=RUN and --out=NEW_DIR are both required')
  try:
    out = export_run(_WORKDIR.value, _OUT.value, _DTYPE.value, _STEP.value)
  except (CheckpointError, ConvertError, checks.ConfigError) as e:
    sys.exit(f'error: {e}')
  print(f'exported    {os.path.abspath(out)}')


if __name__ == '__main__':
  app.run(main)
