"""One table row per finished training run: its recipe, validation loss and the memory of its
compiled train step, with the parameter and optimizer-state bytes read off the state layout.
(Throughput is measured separately, by bench.train_step on an otherwise idle machine: a run's own
tokens/s moves with whatever else the machine is doing.)

  python -m bench.studies.quant_runs runs/default-run runs/q-bf16 runs/q-int8 ...
"""
import json
import os
import sys

from train.metrics import read_rows


def _last_eval(workdir: str) -> float:
  rows = read_rows(os.path.join(workdir, 'metrics.jsonl'))
  return [r for r in rows if 'eval_loss' in r][-1]['eval_loss']


def tree_bytes(tree) -> int:
  """Bytes of every array (or abstract array) in a tree."""
  import jax
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


def main(workdirs: list[str]) -> None:
  from absl import logging
  logging.set_verbosity(logging.WARNING)
  import jax

  from configs import default
  from quant.recipe import describe
  from train import ptq, run

  print('| run | precision | matmuls | Adam | validation loss (nats/byte) '
        '| parameters (bytes/param) | optimizer state (bytes/param) | compiled total per device |')
  print('|---|---|---|---|---:|---:|---:|---:|')
  for workdir in workdirs:
    config = ptq.run_config(workdir, default.get_config())
    s = run.setup(config, devices=jax.devices()[:1])
    with open(os.path.join(workdir, 'memory.json')) as f:
      memory = json.load(f)
    n = memory['num_params']
    loss = _last_eval(workdir)
    print(f'| {os.path.basename(workdir.rstrip("/"))} | {s.policy.name} | {describe(s.policy.matmul)} '
          f'| {config.quant.adam_bits}-bit | {loss:.4f} '
          f'| {tree_bytes(s.layout.abstract["params"]) / n:.3f} '
          f'| {tree_bytes(s.layout.abstract["opt_state"]) / n:.3f} '
          f'| {memory["per_device_bytes"]["total"] / 2**20:.1f} MiB |')


if __name__ == '__main__':
  main(sys.argv[1:])
