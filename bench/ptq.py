"""Post-training quantization of one trained run: validation loss and perplexity with the dense
kernels stored in each format, the bytes they take, and what the compiled evaluation step takes as
arguments. LLM.int8() keeps float weights and quantizes each product; its row also reports the share
of feature columns that took the 16-bit path on the validation batches.

  python -m bench.ptq --workdir=runs/default-run [--save=DIR]   # --save: write the int8 model there
"""
import os
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string('workdir', 'runs/default-run', 'A finished training run.')
_SAVE = flags.DEFINE_string('save', None, 'Also save the int8-quantized model to this new directory.')

# name: (precision policy, stored weight format or None, matmul mode)
ROWS = {
    'fp32 (as trained)': ('fp32', None, 'none'),
    'bf16': ('bf16', None, 'none'),
    'int8 weights': ('bf16_mixed', 'int8', 'none'),
    'int4 weights': ('bf16_mixed', 'int4', 'none'),
    'nf4 weights': ('bf16_mixed', 'nf4', 'none'),
    'LLM.int8()': ('bf16_mixed', None, 'llm_int8'),
}


def _mib(n: int) -> str:
  return f'{n / 2**20:.2f} MiB'


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  import jax
  from flax import nnx

  import data as data_lib
  from configs import default
  from quant.llm_int8 import recording_outliers
  from models.dense import stored_bytes
  from train import checks, ptq, run
  from train.checkpoint import CheckpointError
  from train.validation import figures, make_eval_loop

  if _SAVE.value and os.path.exists(_SAVE.value):   # refused before any work, nothing overwritten
    sys.exit(f'error: --save={_SAVE.value} already exists; choose a new directory')
  try:
    config = ptq.run_config(_WORKDIR.value, default.get_config())
    params = ptq.restore_params(_WORKDIR.value, config)
  except CheckpointError as e:
    sys.exit(f'error: {e}')
  sources = run.open_data(config, _WORKDIR.value)
  if len(sources) > 1:   # one table of losses: a mixture's per-source split is not weighed here
    sys.exit(f'error: the run trained on a mixture of {len(sources)} sources '
             f'({", ".join(name for name, _, _ in sources)}); bench.ptq evaluates one')
  (_, _, prepared), = sources
  windows = data_lib.Windows(prepared.split('val'), config.train.seq_len, config.data.packing)
  batches = data_lib.eval_batches(windows, batch_size=config.train.batch_size,
                                  eval_tokens=config.train.eval_tokens)
  kernels = sum(p.size for path, p in jax.tree_util.tree_leaves_with_path(params)
                if getattr(path[-1], 'key', None) == 'kernel')
  print(f'run {_WORKDIR.value}: {sum(p.size for p in jax.tree.leaves(params)) / 1e6:.2f} M '
        f'parameters, {kernels / 1e6:.2f} M of them in dense kernels; '
        f'{len(batches["inputs"])} validation batches of {config.train.batch_size} x '
        f'{config.train.seq_len} tokens\n')
  print('| weights | compute | validation loss (nats/token ± SEM) | perplexity | dense kernel '
        'bytes/weight | model bytes | eval step arguments | outlier columns |')
  print('|---|---|---:|---:|---:|---:|---:|---:|')
  for name, (precision, fmt, mode) in ROWS.items():
    config.precision, config.quant.mode = precision, mode
    policy = checks.policy(config)
    model = ptq.build_quantized(config, policy, params, fmt)
    graphdef, state = nnx.split(model)
    with recording_outliers() as outliers:   # traced inside, so LLM.int8() products report
      compiled = jax.jit(make_eval_loop(graphdef)).lower(state, {}, batches).compile()
      result = figures(*compiled(state, {}, batches), prepared.bytes_per_token('val'))
    stored = stored_bytes(model)
    other = sum(p.size for path, p in jax.tree_util.tree_leaves_with_path(params)
                if getattr(path[-1], 'key', None) != 'kernel') * policy.param_bytes
    kernel_bytes = stored['quantized'] or stored['params'] - other
    share = (f'{100 * sum(n for n, _ in outliers) / sum(k for _, k in outliers):.2f} %'
             if outliers else '')
    print(f'| {name} | {jax.numpy.dtype(policy.compute_dtype).name} | {result["eval_loss"]:.4f} ± '
          f'{result["eval_loss_sem"]:.4f} | '
          f'{result["eval_perplexity"]:.3f} | {kernel_bytes / kernels:.3f} | '
          f'{_mib(stored["params"] + stored["quantized"])} | '
          f'{_mib(compiled.memory_analysis().argument_size_in_bytes)} | {share} |')
    if _SAVE.value and fmt == 'int8':
      ptq.save_quantized(model, config, fmt, _SAVE.value)


if __name__ == '__main__':
  app.run(main)
