"""Benchmark: generation speed (train/sample.py) in new tokens per second, compile excluded.

  python -m bench.decode                                   # the default model, 1 prompt, 256 tokens
  python -m bench.decode --rows=8 --tokens=480 --window=512
  python -m bench.decode --config=configs/default.py:100m

The weights are the config's fresh initialisation: speed does not depend on their values.
"""
import time

import jax
import numpy as np
from absl import app, flags, logging
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file('config', 'configs/default.py', 'Config file[:preset].')
_ROWS = flags.DEFINE_integer('rows', 1, 'Prompts generated together.')
_PROMPT = flags.DEFINE_integer('prompt_len', 16, 'Tokens in each prompt.')
_TOKENS = flags.DEFINE_integer('tokens', 256, 'New tokens per prompt.')
_WINDOW = flags.DEFINE_integer('window', 0, 'Positions in the window (0: model.max_seq_len).')
_REPEATS = flags.DEFINE_integer('repeats', 3, 'Timed runs after a compiling one; the best counts.')


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  from train.run import setup
  from train.sample import generate_batch

  config = _CONFIG.value
  s = setup(config)
  params = s.layout.init()['params']
  window = _WINDOW.value or s.model.max_seq_len
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, s.model.vocab_size, _PROMPT.value) for _ in range(_ROWS.value)]

  def run():
    out = generate_batch(s.layout.graphdef, params, prompts, num_tokens=_TOKENS.value,
                         window=window, temperature=0.0, seed=0,
                         model_shapes=s.layout.model_shapes)
    return sum(len(o) - len(p) for o, p in zip(out, prompts))

  run()
  best = float('inf')
  for _ in range(_REPEATS.value):
    start = time.perf_counter()
    new_tokens = run()
    best = min(best, time.perf_counter() - start)
  print(f'{config.name} ({s.policy.name}, {jax.devices()[0].platform}), {s.model.num_params / 1e6:.2f} M '
        f'params, {_ROWS.value} prompt(s) of {_PROMPT.value} tokens, window {window}')
  print(f'  generated          {new_tokens} tokens in {best:.3f} s (best of {_REPEATS.value})')
  print(f'  decode speed       {new_tokens / best:,.0f} tokens/s')


if __name__ == '__main__':
  app.run(main)
