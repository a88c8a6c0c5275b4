"""The memory of creating a fine-tune's train state on one device, from compiled memory analyses
(nothing is allocated): the initialiser jitted whole, against the way a run creates it
(train/init_from.py: the rest of the state first, then the frozen base one kernel and one layer at
a time, each layer cast or quantized and written into its stacked array in place).

The peak of the second is bounded by the larger of the first piece (its outputs and temporaries)
and the whole state plus the largest layer's float values and the temporaries of storing them.

  python -m bench.studies.init_memory                          # LoRA and QLoRA at 7B, QLoRA at 20B
  python -m bench.studies.init_memory --config=configs/qlora.py:70b     # any fine-tune config(s)
  python -m bench.studies.init_memory --config=configs/qlora.py:20b --create   # and create it

`--create` also creates each state the way a run does, on this machine's first device, and reports
the seconds it took and the peak memory: the device allocator's peak where the device reports one
(a GPU), else the process's peak resident memory (a CPU: the runtime and the host allocator's
freed-but-kept pages included).
"""
from absl import app, flags, logging

from train.setup import Setup


_CONFIGS = flags.DEFINE_multi_string(
    'config', ['configs/lora.py:7b', 'configs/qlora.py:7b', 'configs/qlora.py:20b'],
    'Config file[:preset] of a fine-tune (lora.rank > 0); repeat the flag for several.')
_CREATE = flags.DEFINE_bool('create', False, 'Also create each state here, timed, with its peak '
                            'memory.')

GB = 1e9


def init_memory(spec: str) -> dict:
  """Compiled bytes of the whole initialiser and of the layer-by-layer pieces, on one device."""
  import jax

  import configs
  from train import init_from
  from train.run import setup
  config = configs.load(spec)
  if not config.lora.rank:
    raise app.UsageError(f'--config={spec} trains every weight (lora.rank=0): it has no frozen '
                         f'base, and its state is made whole')
  config.host_devices, config.parallel.zero_stage = 0, 0
  config.mesh = dict(stage=1, data=1, fsdp=1, tensor=1)
  config.train.batch_size, config.train.microbatches = 1, 1
  s = setup(config, devices=jax.devices()[:1])
  whole = s.layout.init.lower().compile().memory_analysis()
  creation = init_from.creation_bytes(s)
  created = _create(s) if _CREATE.value else {}
  return {**created, 'config': spec, 'state': creation['state'], 'base': s.spec.sizes()[1],
          'whole_temp': whole.temp_size_in_bytes, 'rest': creation['first_piece'],
          'largest_layer': creation['largest_store'], 'layered_peak': creation['peak']}


def _create(s: Setup) -> dict:
  """Creates the state as a run does (init_from.fresh_state); its seconds and peak bytes."""
  import resource
  import time

  import jax

  from memory.compiled import peak_device_memory
  from train import init_from
  start = time.perf_counter()
  jax.block_until_ready(init_from.fresh_state(s))
  seconds = time.perf_counter() - start
  peak = peak_device_memory()
  if peak is None:   # ru_maxrss is in KiB on Linux
    return {'seconds': seconds, 'resident_peak': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
  return {'seconds': seconds, 'device_peak': peak}


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  created = ' | created here in (s) | peak here (GB) |' if _CREATE.value else ' |'
  print('| config | state (GB) | frozen base (GB) | whole initialiser: state + temporaries (GB) '
        '| layer by layer: first piece (GB) | largest layer stored (GB) | layer by layer: peak '
        'bound (GB)' + created)
  print('|---|---:|---:|---:|---:|---:|---:|' + ('---:|---:|' if _CREATE.value else ''))
  for spec in _CONFIGS.value:
    m = init_memory(spec)
    row = (f'| {m["config"]} | {m["state"] / GB:.2f} | {m["base"] / GB:.2f} | '
           f'{(m["state"] + m["whole_temp"]) / GB:,.1f} | {m["rest"] / GB:.2f} | '
           f'{m["largest_layer"] / GB:.3f} | {m["layered_peak"] / GB:.2f} |')
    if _CREATE.value:
      row += f' {m["seconds"]:.0f} | {m.get("device_peak", m.get("resident_peak")) / GB:.2f} |'
    print(row, flush=True)
  print('\nGB = 1e9 bytes; compiled for this machine\'s backend (XLA:CPU), one device.'
        + (' Peak here: the device allocator\'s peak where the device reports one, else the '
           'process\'s peak resident memory (the runtime and pages the host allocator keeps '
           'included).' if _CREATE.value else ''))

if __name__ == '__main__':
  app.run(main)
