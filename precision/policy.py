"""Precision policies: which dtype the weights are stored in and which dtype the math runs in.

A policy is chosen by the config key `precision`. The param dtype is what the weights (and their
gradients) are stored, gathered and reduced in; the compute dtype is what matmuls and activations
use; a master dtype, where there is one, is that of a copy of the weights kept inside the optimizer
state (optim/master.py), which Adam updates and its moments take: bf16 weights with an fp32 master
is the ZeRO paper's split of 16 bytes per parameter, 2 + 2 + 12, with the 12 sharded by ZeRO-1/2/3.
Without one the optimizer updates the weights themselves. Logits are accumulated into fp32 and the
loss computed in fp32 (models/llama.py), because a softmax over 256+ classes in 16 bits loses the
small probabilities that carry the gradient.
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
  master_dtype: jnp.dtype | None = None   # an fp32 copy of the weights in the optimizer state

  @property
  def param_bytes(self) -> int:
    return jnp.dtype(self.param_dtype).itemsize

  @property
  def compute_bytes(self) -> int:
    return jnp.dtype(self.compute_dtype).itemsize

  @property
  def master_bytes(self) -> int:
    """Bytes per parameter of the master copy in the optimizer state (0: none)."""
    return 0 if self.master_dtype is None else jnp.dtype(self.master_dtype).itemsize

  @property
  def update_dtype(self) -> jnp.dtype:
    """The dtype the optimizer updates in, and its moments are stored in (32-bit Adam)."""
    return self.param_dtype if self.master_dtype is None else self.master_dtype

  @property
  def moment_bytes(self) -> int:
    return jnp.dtype(self.update_dtype).itemsize

  @property
  def has_fp32_update(self) -> bool:
    """Whether the optimizer adds its steps to fp32 weights: false for pure bf16, whose updates
    below half a bf16 step of a weight round away (the quality trade-off the planner names)."""
    return jnp.dtype(self.update_dtype).itemsize >= 4


POLICIES = {
    'fp32': Policy('fp32', jnp.float32, jnp.float32, False,
                   'fp32 weights, fp32 compute'),
    'bf16_mixed': Policy('bf16_mixed', jnp.float32, jnp.bfloat16, False,
                         'fp32 master weights, bf16 compute'),
    'bf16': Policy('bf16', jnp.bfloat16, jnp.bfloat16, False,
                   'bf16 weights and optimizer update, bf16 compute'),
    'bf16_master': Policy('bf16_master', jnp.bfloat16, jnp.bfloat16, False,
                          'bf16 weights, gradients and compute; fp32 master weights and Adam '
                          'moments in the optimizer state', master_dtype=jnp.float32),
    'fp16': Policy('fp16', jnp.float32, jnp.float16, True,
                   'fp32 master weights, fp16 compute, dynamic loss scaling'),
}


def get_policy(name: str) -> Policy:
  if name not in POLICIES:
    raise ValueError(f"precision={name!r} is not a known policy; allowed: {', '.join(POLICIES)}")
  return POLICIES[name]
