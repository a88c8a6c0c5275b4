"""Estimated step time of a recipe on a target: compute at an assumed fraction of the devices' peak,
plus the collectives' bytes over their links. A ranking model, not a promise: the assumptions are
printed with every plan.

- Compute: the model's FLOPs per token (6 per matmul weight, plus attention) times the tokens of a
  step, times the recompute of the remat policy (full: the forward runs twice, 8/6; dots: only the
  elementwise work is redone, taken as 1.05), at MFU_ASSUMED of the devices' bf16 peak.
- Data-parallel collectives (ring algorithms: an all-reduce moves 2 (k-1)/k of the buffer per
  device, an all-gather or reduce-scatter (k-1)/k) run over NVLink while the data-parallel group
  fits in one node and over the network beyond it; they overlap with compute:
    DDP       one all-reduce of the gradients per step (microbatches summed locally first)
    ZeRO-1    a reduce-scatter of the gradients and an all-gather of the updated weights per step
    ZeRO-2    a reduce-scatter per microbatch, an all-gather of the weights per step
    ZeRO-3    per microbatch: the weights gathered for the forward and again for the backward pass,
              and the gradients reduce-scattered
- Tensor-parallel collectives (two all-reduces of the layer's activations in the forward pass, two
  in the backward, two more when full remat replays the forward) stay within a node and do not
  overlap with compute.
- The optimizer update is memory-bound: the bytes it reads and writes over HBM bandwidth.
"""
import dataclasses

from models.config import ModelConfig
from plan.target import Target

MFU_ASSUMED = 0.45
RECOMPUTE = {'none': 1.0, 'dots': 1.05, 'full': 8 / 6, 'qkv': 1.2}
ADAM_BYTES_TOUCHED = {32: 4 * 2 * 2, 8: 2 * 2 * 1}   # two moments, read and written, per parameter


@dataclasses.dataclass(frozen=True)
class Recipe:
  precision: str      # bf16_mixed | bf16
  adam_bits: int      # 32 | 8
  zero_stage: int     # 0..3
  tensor: int         # tensor-parallel degree (within a node)
  remat: str          # none | dots | full
  microbatches: int

  def mesh(self, devices: int) -> dict:
    ways = devices // self.tensor
    return (dict(data=ways, fsdp=1, tensor=self.tensor) if self.zero_stage == 0 else
            dict(data=1, fsdp=ways, tensor=self.tensor))

  def __str__(self):
    return (f'{self.precision}, Adam {self.adam_bits}-bit, ZeRO-{self.zero_stage}, '
            f'tensor {self.tensor}, remat {self.remat}, {self.microbatches} microbatch(es)')


def step_seconds(cfg: ModelConfig, recipe: Recipe, batch: int, seq_len: int, target: Target,
                 param_bytes: int, compute_bytes: int) -> dict[str, float]:
  n, t = target.count, recipe.tensor
  dp = n // t
  tokens = batch * seq_len
  compute = (cfg.flops_per_token(seq_len) * tokens * RECOMPUTE[recipe.remat]
             / (n * target.peak_bf16 * MFU_ASSUMED))

  weights = cfg.num_params * param_bytes / t      # one tensor shard of the weights (and grads)
  f = (dp - 1) / dp
  m = recipe.microbatches
  dp_bytes = {0: 2 * f * weights, 1: 2 * f * weights, 2: (m + 1) * f * weights,
              3: m * 3 * f * weights}[recipe.zero_stage]
  dp_link = target.intra_node if n <= target.per_node else target.inter_node
  dp_comm = dp_bytes / dp_link

  rows = batch // (dp * m)
  activation = rows * seq_len * cfg.d_model * compute_bytes
  all_reduces = cfg.num_layers * m * (6 if recipe.remat == 'full' else 4)
  tp_comm = all_reduces * 2 * (t - 1) / t * activation / target.intra_node if t > 1 else 0.0

  sharded = cfg.num_params / (t * (dp if recipe.zero_stage >= 1 else 1))
  touched = sharded * (3 * param_bytes + ADAM_BYTES_TOUCHED[recipe.adam_bits])
  optimizer = touched / target.hbm
  total = max(compute, dp_comm) + tp_comm + optimizer
  return {'compute': compute, 'data_parallel_comm': dp_comm, 'tensor_comm': tp_comm,
          'optimizer': optimizer, 'total': total}
