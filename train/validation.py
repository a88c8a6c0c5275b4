"""Validation: nats per predicted token, bits per byte and perplexity, each with the standard error
of its mean, computed in one jitted loop over a fixed evaluation set; and the run's evaluator.

The evaluation set is fixed (data/pipeline.py: windows spread over the held-out documents). The
standard error treats windows as the samples (the tokens of one window are not independent): with
window i's summed loss s_i over its c_i predicted tokens and the mean m = sum(s) / sum(c),
SEM = sqrt(sum((s_i - m c_i)^2) / (n (n - 1))) / mean(c), the ratio estimator's; with equal c_i it
is the familiar std(window means) / sqrt(n).
"""
import math
from typing import NamedTuple

import jax
import numpy as np
from tqdm import tqdm

from parallel.sharding import replicated
from train.step import token_losses


def make_eval_loop(graphdef, stack=None, model_shapes=None):
  """eval_loop(params, frozen, batches) -> (summed loss, predicted targets), each
  [batches, rows]: `batches` holds arrays [batches, rows, length]; frozen is the LoRA base ({}
  without LoRA); `stack`: how the blocks run (the train step's pipeline); `model_shapes`: the
  true shapes of (params, frozen) where they are stored padded (train/step.py)."""
  def eval_loop(params, frozen, batches):
    if model_shapes is not None:
      params, frozen = model_shapes[0].fit(params), model_shapes[1].fit(frozen)

    def one_batch(_, batch):
      losses = token_losses(graphdef, params, frozen, batch, stack=stack)
      return None, (losses.sum(-1), (batch['targets'] >= 0).sum(-1))
    return jax.lax.scan(one_batch, None, batches)[1]
  return eval_loop


def figures(sums, counts, bytes_per_token: float) -> dict:
  """The evaluation's figures from each window's summed loss and its predicted targets."""
  sums = np.asarray(sums, np.float64).reshape(-1)
  counts = np.asarray(counts, np.float64).reshape(-1)
  sums, counts = sums[counts > 0], counts[counts > 0]
  n = len(counts)
  nats = float(sums.sum() / counts.sum())
  sem = (float(np.sqrt(((sums - nats * counts) ** 2).sum() / (n * (n - 1))) / counts.mean())
         if n > 1 else float('nan'))
  per_bit = 1 / math.log(2) / bytes_per_token
  return {'eval_loss': nats, 'eval_loss_sem': sem,
          'eval_bits_per_byte': nats * per_bit, 'eval_bits_per_byte_sem': sem * per_bit,
          'eval_perplexity': math.exp(nats), 'eval_tokens': int(counts.sum()), 'eval_windows': n}


def describe(result: dict) -> str:
  return (f'loss {result["eval_loss"]:.4f} ± {result["eval_loss_sem"]:.4f} nats/token, '
          f'{result["eval_bits_per_byte"]:.4f} ± {result["eval_bits_per_byte_sem"]:.4f} bits/byte, '
          f'perplexity {result["eval_perplexity"]:.2f} (± one standard error, '
          f'{result["eval_tokens"]:,} tokens in {result["eval_windows"]} windows)')


class EvalSet(NamedTuple):
  """One source's evaluation set: its name ('' for a run's one source), its mixture weight, the
  batches and the source's input bytes per token."""
  name: str
  weight: float
  batches: dict
  bytes_per_token: float


def mixed(results: dict[str, dict], weights: dict[str, float]) -> dict:
  """A mixture's figures: each source's under `<figure>/<name>`, and their mean weighted as the
  training draws the sources (standard errors combined as independent)."""
  out = {}
  for key in ('eval_loss', 'eval_bits_per_byte'):
    out[key] = sum(weights[n] * r[key] for n, r in results.items())
    out[key + '_sem'] = math.sqrt(sum((weights[n] * r[key + '_sem']) ** 2
                                      for n, r in results.items()))
  out['eval_perplexity'] = math.exp(out['eval_loss'])
  for key in ('eval_tokens', 'eval_windows'):
    out[key] = sum(r[key] for r in results.values())
  for name, result in results.items():
    out.update({f'{key}/{name}': value for key, value in result.items()})
  return out


class Evaluator:
  """The run's validation: one jitted loop over the fixed evaluation set of each source, placed
  like the state, and one printed line per evaluation and source (main process).
  `evaluator(state, step)` returns the figures (a mixture's: mixed())."""

  def __init__(self, s, sets: list[EvalSet]):
    self._context = s.context
    self._sets = sets
    with s.context():
      self._loop = jax.jit(make_eval_loop(s.layout.graphdef, s.stack, s.layout.model_shapes),
                           in_shardings=(s.layout.shardings['params'],
                                         s.layout.shardings.get('frozen', {}),
                                         {k: v.sharding for k, v in sets[0].batches.items()}),
                           out_shardings=replicated(s.mesh))

  def __call__(self, state: dict, step: int) -> dict:
    results = {}
    for one in self._sets:
      with self._context():
        sums, counts = jax.device_get(self._loop(state['params'], state.get('frozen', {}),
                                                 one.batches))
      results[one.name] = figures(sums, counts, one.bytes_per_token)
    if len(self._sets) == 1 and self._sets[0].name == '':
      result = results['']
    else:
      result = mixed(results, {one.name: one.weight for one in self._sets})
    if jax.process_index() == 0:
      tqdm.write(f'eval  step {step}: {describe(result)}')
      for name, one in results.items() if len(results) > 1 or '' not in results else ():
        tqdm.write(f'      {name}: {describe(one)}')
    return result
