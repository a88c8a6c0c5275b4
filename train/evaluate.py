"""Validation loss in nats per token, bits per byte and perplexity."""
import math

import jax
import numpy as np

from train.step import cross_entropy


def make_eval_step(graphdef):
  def eval_step(params, batch):
    return cross_entropy(graphdef, params, batch)
  return eval_step


def evaluate(eval_step, params, batches, bytes_per_token: float) -> dict:
  """Average over the (equal-sized) validation batches; `batches` are global arrays."""
  losses = [float(jax.device_get(eval_step(params, batch))) for batch in batches]
  nats = float(np.mean(losses))
  return {'eval_loss': nats,
          'eval_bits_per_byte': nats / math.log(2) / bytes_per_token,
          'eval_perplexity': math.exp(nats)}
