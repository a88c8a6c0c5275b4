"""Validation loss in nats per token, bits per byte and perplexity, and the run's evaluator."""
import math

import jax
import numpy as np
from tqdm import tqdm

from parallel.sharding import replicated
from train.step import cross_entropy


def make_eval_step(graphdef, stack=None):
  """eval_step(params, frozen, batch): frozen is the LoRA base ({} without LoRA); `stack`: how the
  blocks run (the train step's pipeline)."""
  def eval_step(params, frozen, batch):
    return cross_entropy(graphdef, params, frozen, batch, stack=stack)
  return eval_step


def evaluate(eval_step, params, batches, bytes_per_token: float, frozen=None) -> dict:
  """Average over the (equal-sized) validation batches; `batches` are global arrays."""
  frozen = {} if frozen is None else frozen
  losses = [float(jax.device_get(eval_step(params, frozen, batch))) for batch in batches]
  nats = float(np.mean(losses))
  return {'eval_loss': nats,
          'eval_bits_per_byte': nats / math.log(2) / bytes_per_token,
          'eval_perplexity': math.exp(nats)}


class Evaluator:
  """The run's validation: a jitted eval step placed like the state, fixed global batches, and one
  printed line per evaluation (main process). `evaluator(state, step)` returns the figures."""

  def __init__(self, s, batches: list, bytes_per_token: float):
    self._context = s.context
    self._batches = batches
    self._bytes_per_token = bytes_per_token
    batch = {'inputs': s.batch_sharding, 'targets': s.batch_sharding}
    with s.context():
      self._step = jax.jit(make_eval_step(s.layout.graphdef, s.stack),
                           in_shardings=(s.layout.shardings['params'],
                                         s.layout.shardings.get('frozen', {}), batch),
                           out_shardings=replicated(s.mesh))

  def __call__(self, state: dict, step: int) -> dict:
    with self._context():
      result = evaluate(self._step, state['params'], self._batches, frozen=state.get('frozen'),
                        bytes_per_token=self._bytes_per_token)
    if jax.process_index() == 0:
      tqdm.write(f'eval  step {step}: loss {result["eval_loss"]:.4f} nats/token, '
                 f'{result["eval_bits_per_byte"]:.4f} bits/byte, perplexity '
                 f'{result["eval_perplexity"]:.2f}')
    return result
