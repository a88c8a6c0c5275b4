"""Validation loss in nats per token, bits per byte and perplexity."""
import math

import jax
import numpy as np

from train.step import cross_entropy


def make_eval_step(graphdef):
  """eval_step(params, frozen, batch): frozen is the LoRA base ({} without LoRA)."""
  def eval_step(params, frozen, batch):
    return cross_entropy(graphdef, params, frozen, batch)
  return eval_step


def evaluate(eval_step, params, batches, bytes_per_token: float, frozen=None) -> dict:
  """Average over the (equal-sized) validation batches; `batches` are global arrays."""
  frozen = {} if frozen is None else frozen
  losses = [float(jax.device_get(eval_step(params, frozen, batch))) for batch in batches]
  nats = float(np.mean(losses))
  return {'eval_loss': nats,
          'eval_bits_per_byte': nats / math.log(2) / bytes_per_token,
          'eval_perplexity': math.exp(nats)}
