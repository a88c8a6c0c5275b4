"""Analytic per-device memory of a train step: parameters, gradients, optimizer state, activations.

A first model, stated so it can be checked against the compiler (memory.json holds both):
- parameters are stored in the policy's param dtype, split `tensor` ways (tensor parallelism
  splits every matmul weight and the vocabulary; the norm scales it does not split are negligible)
  and `fsdp` ways under ZeRO-3;
- gradients have the parameters' size and dtype (they are accumulated in it), split `fsdp` ways
  under ZeRO-2 and 3;
- AdamW keeps two moments of the same size and dtype, split `fsdp` ways under ZeRO-1, 2 and 3;
  with 8-bit moments, one byte per value plus an fp32 scale per block, except the norm scales
  (too small to quantize), which stay fp32;
- activations: what the backward pass keeps for one microbatch on one device, per layer, given the
  remat policy, plus the fp32 logits, their softmax and gradient, and one layer's working set that
  is rebuilt during the backward pass when remat is on. Tensor parallelism splits the attention
  and MLP activations and the logits; the residual stream stays whole.
"""
import dataclasses

from models.config import ModelConfig
from quant.precision import Policy

FP32 = 4


@dataclasses.dataclass(frozen=True)
class StepShape:
  rows_per_device: int   # sequences in one microbatch on one device
  seq_len: int
  fsdp: int = 1          # size of the mesh's fsdp axis
  tensor: int = 1        # size of the mesh's tensor axis
  zero_stage: int = 0
  microbatches: int = 1
  adam_bits: int = 32
  adam_block_size: int = 2048

  def shards(self, from_stage: int) -> int:
    """Ways a piece of state is split: `tensor`, and `fsdp` once zero_stage reaches from_stage."""
    return self.tensor * (self.fsdp if self.zero_stage >= from_stage else 1)


def saved_per_token_per_layer(cfg: ModelConfig, policy: Policy, seq_len: int) -> dict[str, float]:
  """Bytes one token leaves behind in one layer for the backward pass, with no remat."""
  c = policy.compute_bytes
  qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  return {
      'residual_and_norms': 4 * cfg.d_model * c + 2 * cfg.d_model * FP32,  # inputs, normed, fp32 norm math
      'qkv': 2 * qkv * c,                                  # projections before and after rotary
      'attention_scores': 2 * cfg.num_heads * seq_len * c,  # logits and softmax probabilities
      'attention_out': cfg.num_heads * cfg.head_dim * c,
      'mlp': 4 * cfg.mlp_dim * c,                          # gate, up, silu(gate), product
  }


def activation_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  tokens = shape.rows_per_device * shape.seq_len
  saved = saved_per_token_per_layer(cfg, policy, shape.seq_len)
  saved = {k: v if k == 'residual_and_norms' else v / shape.tensor for k, v in saved.items()}
  full_layer = sum(saved.values())
  carry = cfg.d_model * policy.compute_bytes              # the residual stream between layers
  kept_by_policy = {
      'none': full_layer,
      'full': carry,
      'dots': carry + (saved['qkv'] + saved['attention_out'] + saved['mlp']) * 3 / 4,
      'qkv': carry + saved['qkv'] / 2,
  }[cfg.remat]
  rebuilt = 0 if cfg.remat == 'none' else full_layer       # one layer recomputed at a time
  # The backward pass of attention holds, besides what was saved, two fp32 [heads, length] rows per
  # token (the gradients of the probabilities and of the scores); fitted to XLA's compiled
  # temporaries at 1k-4k tokens, where these rows dominate.
  attention_backward = 2 * cfg.num_heads * shape.seq_len * FP32 / shape.tensor
  logits = 3 * cfg.vocab_size * FP32 / shape.tensor        # logits, softmax, their gradient
  return tokens * (cfg.num_layers * kept_by_policy + rebuilt + attention_backward + logits)


def temporary_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Buffers that are neither state nor activations: under ZeRO-3 the gathered weights of the
  layer in use and of the next one (gathered ahead), and the embedding and output head while they
  are used; with microbatches, one microbatch's gradients beside the accumulator."""
  p = policy.param_bytes
  gathered = 0
  if shape.zero_stage >= 3 and shape.fsdp > 1:
    head = 0 if cfg.tie_embeddings else cfg.embedding_params
    gathered = (2 * cfg.params_per_layer + cfg.embedding_params + head) * p / shape.tensor
  microbatch_grads = cfg.num_params * p / shape.shards(from_stage=2) if shape.microbatches > 1 else 0
  return gathered + microbatch_grads


def moment_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Bytes of one Adam moment for the whole model."""
  if shape.adam_bits == 32:
    return cfg.num_params * policy.param_bytes
  norms = (2 * cfg.num_layers + 1) * cfg.d_model
  return (cfg.num_params - norms) * (1 + FP32 / shape.adam_block_size) + norms * FP32


def estimate(cfg: ModelConfig, policy: Policy, shape: StepShape) -> dict[str, float]:
  n = cfg.num_params
  p = policy.param_bytes
  parts = {
      'params': n * p / shape.shards(from_stage=3),
      'grads': n * p / shape.shards(from_stage=2),
      'optimizer': 2 * moment_bytes(cfg, policy, shape) / shape.shards(from_stage=1),
      'activations': activation_bytes(cfg, policy, shape),
      'temporaries': temporary_bytes(cfg, policy, shape),
  }
  parts = {k: int(v) for k, v in parts.items()}
  parts['total'] = sum(parts.values())
  return parts
