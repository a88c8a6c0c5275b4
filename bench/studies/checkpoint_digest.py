"""What the checkpoint digests cost (train/digest.py): a real train state saved and restored with
orbax, each way timed with and without the digests, rounds interleaved, best of each kept.

  python -m bench.studies.checkpoint_digest                       # the 100m preset, fp32 and Adam
  python -m bench.studies.checkpoint_digest --config=configs/default.py:tiny --rounds=2

Figures (seconds): `call` is the save call, what the training loop waits for (the arrays copied
off the devices; the digests are only dispatched, and writing goes on in the background); `save`
is the call plus the wait until the checkpoint and its digests are written; `digest` is the
digests of the whole state alone; `restore` reads it back; `verify` recomputes and compares. Writes bench/results/checkpoint_digest.json.
"""
import json
import os
import platform
import shutil
import tempfile
import time

from absl import app, flags, logging

_CONFIG = flags.DEFINE_string('config', 'configs/default.py:100m', 'Config file[:preset].')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Interleaved rounds; the best of each figure is kept.')
_OUT = flags.DEFINE_string('out', os.path.join(os.path.dirname(os.path.dirname(__file__)),
                                               'results', 'checkpoint_digest.json'), 'JSON output.')


def _timed(fn):
  start = time.perf_counter()
  result = fn()
  return time.perf_counter() - start, result


def measure(spec: str, rounds: int) -> dict:
  import jax
  import orbax.checkpoint as ocp

  import configs
  from bench.studies.quant_runs import tree_bytes
  from train import init_from
  from train.checkpoint import Checkpointer
  from train.digest import tree_digests
  from train.run import checkpoint_meta, setup

  config = configs.load(spec)
  config.mesh = {'data': 1, 'fsdp': 1, 'tensor': 1}
  s = setup(config, devices=jax.devices()[:1])
  state = init_from.fresh_state(s, None)
  meta, data = checkpoint_meta(s), {'step': 0}
  jax.block_until_ready(tree_digests(state))   # compiled once, as in a run
  figures = {name: [] for name in ('call_with', 'call_without', 'save_with', 'save_without',
                                   'digest', 'restore', 'verify')}
  root = tempfile.mkdtemp(prefix='digest-bench-')
  try:
    for i in range(rounds):
      checkpoints = Checkpointer(os.path.join(root, f'with-{i}'), keep=1)
      call, _ = _timed(lambda: checkpoints.save(1, state, data, meta))
      seconds, _ = _timed(checkpoints.wait)
      figures['call_with'].append(call)
      figures['save_with'].append(call + seconds)
      figures['digest'].append(_timed(lambda: tree_digests(state))[0])
      seconds, (restored, read) = _timed(lambda: checkpoints.restore(1, s.layout.abstract))
      figures['restore'].append(seconds)
      figures['verify'].append(_timed(lambda: checkpoints.verify(1, restored, read))[0])
      del restored
      checkpoints.close()
      # The same save through orbax with no digest computed: what a save cost before them.
      plain = Checkpointer(os.path.join(root, f'without-{i}'), keep=1)
      call, _ = _timed(lambda: plain._manager.save(1, args=ocp.args.Composite(
          state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data),
          meta=ocp.args.JsonSave(meta))))
      seconds, _ = _timed(plain.wait)
      figures['call_without'].append(call)
      figures['save_without'].append(call + seconds)
      plain.close()
  finally:
    shutil.rmtree(root, ignore_errors=True)
  best = {name: min(values) for name, values in figures.items()}
  return {
      'config': spec, 'state_bytes': tree_bytes(state), 'rounds': rounds,
      'seconds': best, 'all_seconds': figures,
      'digest_share_of_save': best['digest'] / best['save_without'],
      'call_overhead': best['call_with'] / best['call_without'] - 1,
      'save_overhead': best['save_with'] / best['save_without'] - 1,
      'verify_share_of_restore': best['verify'] / best['restore'],
      'machine': f'{platform.processor() or platform.machine()}, {os.cpu_count()} cores',
      'device': jax.devices()[0].device_kind, 'jax': jax.__version__,
  }


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  result = measure(_CONFIG.value, _ROUNDS.value)
  s = result['seconds']
  print(f'{result["config"]}: state {result["state_bytes"] / 1e9:.3f} GB; the save call (what the '
        f'loop waits for) {s["call_without"]:.3f} s without digests, {s["call_with"]:.3f} s with '
        f'({100 * result["call_overhead"]:+.1f} %); until committed {s["save_without"]:.2f} s / '
        f'{s["save_with"]:.2f} s ({100 * result["save_overhead"]:+.1f} %); the digests alone '
        f'{s["digest"]:.3f} s ({100 * result["digest_share_of_save"]:.0f} % of a save, in the '
        f'background); restore {s["restore"]:.2f} s, verify {s["verify"]:.3f} s '
        f'({100 * result["verify_share_of_restore"]:.0f} % of a restore)')
  os.makedirs(os.path.dirname(_OUT.value), exist_ok=True)
  with open(_OUT.value, 'w', encoding='utf-8') as f:
    json.dump(result, f, indent=2, sort_keys=True)
    f.write('\n')


if __name__ == '__main__':
  app.run(main)
