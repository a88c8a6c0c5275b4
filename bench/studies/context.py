"""Context parallelism against sequence length: compiled per-device memory (total and temp) beside
the analytic estimate, and the collectives of a step. Nothing is allocated.

  python -m bench.studies.context            # docs/parallel.md's table: 7b, 32k/64k/128k x context 1-8
  python -m bench.studies.context --context_attention=ring --contexts=2,4,8   # the same, a ring
  python -m bench.studies.context --seq_lens=8192 --contexts=1,2 --preset=1b
  python -m bench.studies.context --compose [--context_attention=ring]   # every precision / quant
                                                        # mode / LoRA over context shards

For each length and context size C the mesh is C context x (devices / C) fsdp under ZeRO-3, with
one sequence per fsdp group (batch devices / C), remat full and a 4096-position loss chunk: every
point runs the same tokens per device pair of (fsdp, context) rows. The key/value traffic of the
context-parallel attention (all-gathers of [rows, length, kv_heads, head_dim] and the
reduce-scatters of their gradients) is read from the program as the SPMD partitioner leaves it
(the dtype the step asks for, bf16 here, as a GPU moves it; XLA:CPU's optimised program gathers
fp32 copies) beside the estimate's `context_collective_bytes`.
"""
import json
import math
import re
import sys

from absl import app, flags, logging

_SEQ = flags.DEFINE_list('seq_lens', ['32768', '65536', '131072'], 'Sequence lengths.')
_CONTEXTS = flags.DEFINE_list('contexts', ['1', '2', '4', '8'], 'Context-axis sizes.')
_PRESET = flags.DEFINE_string('preset', '7b', 'Model preset.')
_DEVICES = flags.DEFINE_integer('devices', 8, 'Simulated devices.')
_METHOD = flags.DEFINE_enum('context_attention', 'gather', ['gather', 'ring'],
                           'model.context_attention: all-gathered keys and values, or a ring.')
_OUT = flags.DEFINE_string('out', None, 'Where the rows are written (default '
                           'bench/results/context_7b.json, context_7b_ring.json with a ring).')
_COMPOSE = flags.DEFINE_bool('compose', False, 'Instead: two steps of each precision, quant mode '
                             'and LoRA variant (bench/studies/compose.py:VARIANTS) over 2 context '
                             'x 2 fsdp x 2 tensor devices (ZeRO-3, packed rows) and on one device.')


def compose() -> None:
  import jax
  from bench.studies.compose import table
  from configs import default
  from configs.layouts import layout_config

  def config_for(overrides, one_device):
    mesh = dict(stage=1, data=1, fsdp=1, context=1, tensor=1) if one_device else dict(
        stage=1, data=1, fsdp=2, context=2, tensor=2)
    config = layout_config('fsdp', 'tiny')
    for key, value in {'train.seq_len': 64, 'train.batch_size': 4, 'mesh': mesh,
                       'model.context_attention': _METHOD.value, **overrides}.items():
      default.override(config, key, value)
    return config, jax.devices()[:math.prod(mesh.values())]

  table('context x fsdp x tensor', config_for, packed=True)


def _kv_collectives(lowered, num_devices: int, seq_len: int, context: int,
                    ring: bool) -> dict[str, dict[str, int]]:
  """The partitioned program's collectives that move keys and values: whose array has a whole
  sequence's length next to the batch (the gathered keys and values, their gradients before the
  reduce-scatter), or with a ring every collective-permute (the step has no other)."""
  from parallel.collectives import KINDS, collective_stats, partitioned_text
  # An all-gather's result is the whole sequence; a reduce-scatter's the shard's (its operand's
  # shape is not written on its line).
  kv_shape = re.compile(rf'\[\d+,({seq_len}|{seq_len // context}),\d+,\d+\]')
  lines = partitioned_text(lowered).splitlines()
  collective = re.compile(r'(' + '|'.join(KINDS) + r')(-start)?\(')

  def moves_keys(line: str) -> bool:
    op = collective.search(line)
    if op is None:
      return True   # not a collective: kept (the computations and loops around them)
    if ring:
      return op.group(1) == 'collective-permute'
    return bool(kv_shape.search(line.split('=', 1)[-1])
                and (op.group(1) == 'reduce-scatter') == (f',{seq_len},' not in line))

  kept = [line for line in lines if moves_keys(line)]
  return collective_stats('\n'.join(kept), num_devices)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  jax.config.update('jax_num_cpu_devices', _DEVICES.value)
  from configs import default
  from configs.layouts import layout_config
  from memory.estimate import context_collective_bytes
  from train import run
  GiB = 2.0 ** 30
  if _COMPOSE.value:
    return compose()

  ring = _METHOD.value == 'ring'
  out = _OUT.value or f'bench/results/context_7b{"_ring" if ring else ""}.json'
  kinds = ['collective-permute'] if ring else ['all-gather', 'reduce-scatter']
  rows = []
  print('| tokens | context | compiled GiB/device | temp GiB | estimate GiB (error) '
        '| all-gather GiB | reduce-scatter GiB | '
        + ' | '.join(f'KV {kind} GiB: partitioned, estimate' for kind in kinds) + ' |')
  print('|---:|---:|---:|---:|---:|---:|---:|' + '---:|' * len(kinds))
  for seq_len in map(int, _SEQ.value):
    for context in map(int, _CONTEXTS.value):
      config = layout_config('fsdp', _PRESET.value)
      fsdp = _DEVICES.value // context
      for key, value in {'mesh.fsdp': fsdp, 'mesh.context': context, 'mesh.data': 1,
                         'train.seq_len': seq_len, 'model.max_seq_len': seq_len,
                         'train.batch_size': fsdp, 'train.microbatches': 1,
                         'model.remat': 'full', 'model.loss_chunk': 4096,
                         'model.context_attention': _METHOD.value}.items():
        default.override(config, key, value)
      s = run.setup(config)
      lowered = run.lower_train_step(s)
      with s.context():
        compiled = lowered.compile()
        kv = _kv_collectives(lowered, s.mesh.size, seq_len, context, ring) if context > 1 else None
      memory = run.memory_report(s, compiled)
      shape = run.step_shape(s)
      kv_estimate = context_collective_bytes(s.spec.config, s.spec.policy, shape)
      collectives = memory['collectives_per_step']
      row = {'seq_len': seq_len, 'context': context, 'mesh': memory['mesh'],
             'compiled_bytes': memory['per_device_bytes']['total'],
             'temp_bytes': memory['per_device_bytes']['temp'],
             'estimate_bytes': memory['estimate_bytes']['total'],
             'estimate_parts': memory['estimate_bytes'],
             'collectives': collectives, 'kv_collectives': kv, 'kv_estimate': kv_estimate}
      rows.append(row)
      error = row['estimate_bytes'] / row['compiled_bytes'] - 1
      pair = lambda kind: ('-' if kv is None else
                           f'{kv[kind]["bytes"] / GiB:.2f}, {kv_estimate[kind] / GiB:.2f}')
      print(f'| {seq_len} | {context} | {row["compiled_bytes"] / GiB:.2f} '
            f'| {row["temp_bytes"] / GiB:.2f} | {row["estimate_bytes"] / GiB:.2f} ({error:+.1%}) '
            f'| {collectives["all-gather"]["bytes"] / GiB:.1f} '
            f'| {collectives["reduce-scatter"]["bytes"] / GiB:.1f} | '
            + ' | '.join(pair(kind) for kind in kinds) + ' |')
      sys.stdout.flush()
  with open(out, 'w', encoding='utf-8') as f:
    json.dump({'jax': jax.__version__, 'preset': _PRESET.value,
               'context_attention': _METHOD.value, 'rows': rows}, f, indent=1)
    f.write('\n')


if __name__ == '__main__':
  app.run(main)
