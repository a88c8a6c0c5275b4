"""Precision policies: which dtype the weights are stored in and which dtype the math runs in.

A policy is chosen by the config key `precision`. Master weights are what the optimizer updates;
compute dtype is what matmuls and activations use. Logits and the loss are always computed in fp32,
because a softmax over 256+ classes in 16 bits loses the small probabilities that carry the gradient.
"""
import dataclasses

import jax.numpy as jnp

from quant.recipe import MatmulRecipe


@dataclasses.dataclass(frozen=True)
class Policy:
  name: str
  param_dtype: jnp.dtype     # master weights (what is stored and updated)
  compute_dtype: jnp.dtype   # matmuls and activations
  loss_scaling: bool         # dynamic loss scaling (needed by fp16's narrow exponent range)
  description: str
  matmul: MatmulRecipe = MatmulRecipe()   # the quantized product every Dense runs (quant.*)

  @property
  def param_bytes(self) -> int:
    return jnp.dtype(self.param_dtype).itemsize

  @property
  def compute_bytes(self) -> int:
    return jnp.dtype(self.compute_dtype).itemsize


POLICIES = {
    'fp32': Policy('fp32', jnp.float32, jnp.float32, False,
                   'fp32 weights, fp32 compute'),
    'bf16_mixed': Policy('bf16_mixed', jnp.float32, jnp.bfloat16, False,
                         'fp32 master weights, bf16 compute'),
    'bf16': Policy('bf16', jnp.bfloat16, jnp.bfloat16, False,
                   'bf16 weights and optimizer update, bf16 compute'),
    'fp16': Policy('fp16', jnp.float32, jnp.float16, True,
                   'fp32 master weights, fp16 compute, dynamic loss scaling'),
}


def get_policy(name: str) -> Policy:
  if name not in POLICIES:
    raise ValueError(f"precision={name!r} is not a known policy; allowed: {', '.join(POLICIES)}")
  return POLICIES[name]
