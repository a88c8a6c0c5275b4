"""Estimated step time of a recipe on a target: compute at an assumed fraction of the devices' peak,
plus the collectives' bytes over their links. A ranking model, not a promise: the assumptions are
printed with every plan.

- Compute: the model's FLOPs per token (6 per matmul weight, plus attention; 4 per weight with a
  frozen base, LoRA: no weight gradients) times the tokens of a step, plus the recompute of the
  remat policy as a share of the full training FLOPs (full: the forward runs again, 2/6; dots:
  only the elementwise work is redone, taken as 0.05), at MFU_ASSUMED of the devices' bf16 peak.
- Data-parallel collectives (ring algorithms: an all-reduce moves 2 (k-1)/k of the buffer per
  device, an all-gather or reduce-scatter (k-1)/k) run over NVLink while the data-parallel group
  fits in one node and over the network beyond it; they overlap with compute:
    DDP       one all-reduce of the gradients per step (microbatches summed locally first;
              per microbatch where cuDNN's attention runs on packed rows: train/run.py)
    ZeRO-1    a reduce-scatter of the gradients and an all-gather of the updated weights per step
    ZeRO-2    a reduce-scatter per microbatch, an all-gather of the weights per step
    ZeRO-3    per microbatch: the weights gathered for the forward and again for the backward pass,
              and the gradients reduce-scattered
- Tensor-parallel collectives (two all-reduces of the layer's activations in the forward pass, two
  in the backward, two more when full remat replays the forward) stay within a node and do not
  overlap with compute.
- The optimizer update is memory-bound: the bytes it reads and writes over HBM bandwidth (the
  weights and gradient, the moments in their stored dtype, and an fp32 master copy where the
  policy keeps one).
- With the optimizer state in host memory (`parallel.offload_optimizer`), the update also streams
  that state (fp32 master and moments) to the device and back over the host link (PCIe or
  NVLink-C2C), not overlapped: the update runs after the backward pass.
- Pipeline stages (GPipe, circular, 1F1B, interleaved 1F1B or ZB-H1, offered for targets beyond
  one node; the mesh is stage-major, so a stage's data-parallel and tensor devices are
  neighbours): compute stretched by the bubble, (M R + P - 1) / (M R) with R chunks a stage (ZB-H1:
  (3M + P - 1) / 3M); 1F1B, interleaved 1F1B and circular recompute each chunk's forward in its
  backward (one more forward pass); the 1F1B schedules and ZB-H1 under ZeRO-3 gather a stage's
  weights once per step; ZeRO-2/3's other per-microbatch collectives once per loop iteration, of
  one chunk's weights; with R > 1, the weights' and gradients' re-layout over the stages once per
  step; and the collective-permutes of the activation (forward) and its gradient (backward) at
  every tick, over the network between nodes, not overlapped. A stage runs R chunks of
  ceil(L / (P R)) layers.
- Context shards (offered within a node, `mesh.context`): each layer's keys and values all-gathered
  for its forward pass (and again where remat replays it) and their gradients reduce-scattered,
  over NVLink, not overlapped (the attention waits for them); or passed around a ring (the
  gradients in fp32 beside them backward), overlapped with compute (each transfer is issued before
  the blocks of the step it does not feed); the data-parallel collectives run
  over the data-parallel devices and the context shards together (they share one copy of the
  model), and each device runs 1/context of every sequence.
"""
import dataclasses

from memory.estimate import StepShape, moment_bytes
from models.config import ModelConfig
from parallel.rules import zero_shards
from plan.target import Target
from precision.policy import Policy

MFU_ASSUMED = 0.45
RECOMPUTE = {'none': 1.0, 'dots': 1.05, 'full': 8 / 6, 'qkv': 1.2, 'offload': 8 / 6,
             'dots_offload': 1.05}


@dataclasses.dataclass(frozen=True)
class Recipe:
  precision: str      # bf16_master | bf16_mixed | bf16 (precision/policy.py)
  adam_bits: int      # 32 | 8
  zero_stage: int     # 0..3
  tensor: int         # tensor-parallel degree (within a node)
  remat: str          # none | dots | full
  microbatches: int
  stages: int = 1                  # pipeline stages, across nodes
  pipeline_microbatches: int = 1   # what the pipeline splits each microbatch into
  offload: bool = False            # the optimizer's state in host memory
  schedule: str = 'gpipe'          # with stages: gpipe, circular, 1f1b, interleaved_1f1b
                                   # (parallel/pipeline_1f1b.py) or zb_h1 (parallel/pipeline_zb.py)
  repeats: int = 1                 # circular, interleaved_1f1b: layer chunks per stage
  context: int = 1                 # shards of each sequence (models/context.py), within a node
  context_attention: str = 'gather'   # with context: gather or ring (model.context_attention)

  def mesh(self, devices: int) -> dict:
    ways = devices // (self.tensor * self.stages * self.context)
    split = dict(data=ways, fsdp=1) if self.zero_stage == 0 else dict(data=1, fsdp=ways)
    return dict(stage=self.stages, **split, context=self.context, tensor=self.tensor)

  @property
  def pipeline_iterations(self) -> int:
    """Ticks of the pipeline's loop per microbatch of the accumulation: each a forward and a
    whole backward of one chunk (gpipe, 1f1b; circular and interleaved_1f1b, a stage's 1 / R of
    its layers: M R + P - 1 of them), or one of F, B and W per stage (zb_h1: its tables' count)."""
    if self.schedule == 'zb_h1':
      return 3 * self.pipeline_microbatches + self.stages - 1
    return self.pipeline_microbatches * self.repeats + self.stages - 1

  @property
  def pipeline_work(self) -> int:
    """Of those ticks, the ones a stage works (the rest is the bubble), and under the vmapped
    schedules the ones it computes (its vmap computes the bubble's too; zb_h1's branches do not)."""
    if self.schedule == 'zb_h1':
      return 3 * self.pipeline_microbatches
    return self.pipeline_microbatches * self.repeats

  @property
  def pipeline_ticks(self) -> int:
    """Ticks at which every stage sends its activation on and its gradient back: the 1F1B
    schedules' loop runs R P + M R + P - 2 (parallel/pipeline.py: PipelineSchedule.iterations),
    the others one per iteration."""
    if self.stages > 1 and self.schedule in ('1f1b', 'interleaved_1f1b'):
      R, P, M = self.repeats, self.stages, self.pipeline_microbatches
      return R * P + M * R + P - 2
    return self.pipeline_iterations

  @property
  def recomputes(self) -> bool:
    """Whether each chunk's forward runs again in its backward (1f1b and interleaved_1f1b's
    backward slot, circular's checkpointed chunk): one more forward pass."""
    return self.stages > 1 and (self.schedule in ('1f1b', 'interleaved_1f1b') or (
        self.schedule == 'circular' and self.repeats > 1))

  @property
  def remat_replays(self) -> int:
    """How often the remat policy's recomputation runs per layer and microbatch: twice under
    zb_h1, whose B and W each call the layer's pullback (parallel/pipeline_zb.py)."""
    return 2 if self.stages > 1 and self.schedule == 'zb_h1' else 1

  def __str__(self):
    chunks = f', {self.repeats} chunks a stage' if self.repeats > 1 else ''
    pipeline = (f', {self.stages} stages x {self.pipeline_microbatches} pipeline microbatches '
                f'({self.schedule}{chunks})' if self.stages > 1 else '')
    offload = ', optimizer state in host memory' if self.offload else ''
    context = (f', context {self.context} ({self.context_attention})' if self.context > 1
               else '')
    return (f'{self.precision}, Adam {self.adam_bits}-bit, ZeRO-{self.zero_stage}, '
            f'tensor {self.tensor}{context}, remat {self.remat}, {self.microbatches} '
            f'microbatch(es){pipeline}{offload}')


def step_seconds(cfg: ModelConfig, recipe: Recipe, batch: int, seq_len: int, target: Target,
                 policy: Policy, base_trains: bool = True,
                 reduces_every_microbatch: bool = False) -> dict[str, float]:
  """Seconds per step by part, and the bytes behind the communication parts. Weights are gathered
  and gradients reduced in the policy's param dtype. `base_trains=False`: LoRA (the compute has
  no weight gradients; the optimizer and the collectives are still sized as full training, an
  over-estimate that is small beside the compute on one node). `reduces_every_microbatch`: the
  step cannot sum replicated gradients per device (train/checks.py:unbatchable_attention), so DDP
  and ZeRO-1 all-reduce them after every microbatch."""
  param_bytes, compute_bytes = policy.param_bytes, policy.compute_bytes
  n, t, P, c = target.count, recipe.tensor, recipe.stages, recipe.context
  # The devices that share one copy of the model: the data-parallel ones and the context shards.
  dp = n // (t * P)
  tokens = batch * seq_len
  # A pipeline's stages idle for the bubble: (M R + P - 1) iterations of work for M R (zb_h1:
  # 3M + P - 1 ticks for 3M).
  bubble = recipe.pipeline_iterations / recipe.pipeline_work
  flops = (cfg.flops_per_token(seq_len, base_trains)
           + recipe.remat_replays * (RECOMPUTE[recipe.remat] - 1) * cfg.flops_per_token(seq_len))
  if recipe.recomputes:   # each chunk's forward runs again in its backward
    flops += cfg.flops_per_token(seq_len) / 3
  # Stages run in step, each as deep as the deepest: R chunks of ceil(L / (P R)) layers where P R
  # does not divide L (the default split: parallel/stage_layers.py).
  stage_layers = recipe.repeats * -(-cfg.num_layers // (P * recipe.repeats))
  uneven = P * stage_layers / cfg.num_layers
  compute = flops * tokens * bubble * uneven / (n * target.peak_bf16 * MFU_ASSUMED)

  weights = cfg.num_params * param_bytes / (t * P)   # one tensor shard of a stage's weights
  chunk = weights / recipe.repeats   # what one iteration of the loop computes with
  f = (dp - 1) / dp
  # Per microbatch, and in a pipeline per iteration of its loop (bubble included): ZeRO-2/3's
  # gradient reduction, and ZeRO-3's gathers (measured at 70B with full remat: the compiler
  # gathers a stage's weights at every iteration, 2.5x the unpipelined bytes at M = 4, P = 2).
  # (zb_h1: per microbatch, its F, B and W compute as one iteration of the others, and its W
  # reduces the gradient.) With R chunks a stage, an iteration's are one chunk's.
  zero_bubble = P > 1 and recipe.schedule == 'zb_h1'
  m = recipe.microbatches * (recipe.pipeline_microbatches if zero_bubble else
                             recipe.pipeline_iterations if P > 1 else 1)
  dp_bytes = {0: 2 * f * weights, 1: 2 * f * weights, 2: m * f * chunk + f * weights,
              3: m * 3 * f * chunk}[recipe.zero_stage]
  # The 1F1B schedules and zb_h1 under ZeRO-3 gather a stage's weights once per step and reduce
  # at every tick (zb_h1: every W).
  backward_in_loop = P > 1 and recipe.schedule in ('1f1b', 'interleaved_1f1b', 'zb_h1')
  if backward_in_loop and zero_shards(recipe.zero_stage, 'params'):
    dp_bytes = recipe.microbatches * f * weights + m * f * chunk
  # zb_h1 with replicated gradients has no per-device accumulation (train/run.py): each W's
  # gradient is all-reduced; nor has a step whose attention cannot be batched over the devices.
  if zero_bubble and not zero_shards(recipe.zero_stage, 'grads'):
    dp_bytes = 2 * m * f * weights
  elif reduces_every_microbatch and P == 1 and not zero_shards(recipe.zero_stage, 'grads'):
    dp_bytes = 2 * recipe.microbatches * f * weights
  # The mesh is stage-major: the data-parallel and tensor devices of a stage are n / P neighbours.
  dp_link = target.intra_node if n // P <= target.per_node else target.inter_node
  dp_comm = dp_bytes / dp_link

  rows = batch // (dp // c * recipe.microbatches * recipe.pipeline_microbatches)
  activation = rows * seq_len // c * cfg.d_model * compute_bytes
  chunk_layers = stage_layers / recipe.repeats   # the layers an iteration runs
  all_reduces = chunk_layers * m * (6 if recipe.remat == 'full' else 4)
  tp_bytes = all_reduces * 2 * (t - 1) / t * activation if t > 1 else 0.0
  tp_comm = tp_bytes / target.intra_node
  # Every iteration each stage sends its activation on and, backward, its gradient back: over the
  # network when a stage is a node or more, on the critical path (GPipe does not overlap them).
  permute_link = target.inter_node if n // P >= target.per_node else target.intra_node
  # (zb_h1 sends both at every tick, 3M + P - 1 of them.)
  ticks = recipe.microbatches * recipe.pipeline_ticks
  pipeline_bytes = 2 * ticks * activation / t if P > 1 else 0.0
  # With R chunks a stage, chunk r P + p on stage p: the stored contiguous blocks are re-laid
  # out once per step, the weights and (backward) their gradients, an all-to-all over the stages.
  if recipe.repeats > 1:
    pipeline_bytes += 2 * weights * (P - 1) / P
  pipeline_comm = pipeline_bytes / permute_link
  # Context shards gather every layer's keys and values (again under remat) and reduce-scatter
  # their gradients: in front of the attention that needs them, so on the critical path. A ring
  # moves the same keys and values a shard at a time (the gradients, fp32, beside them backward),
  # each transfer issued before the step's blocks are computed: overlapped with compute.
  kv = 2 * rows * seq_len * cfg.num_kv_heads * cfg.head_dim / t * compute_bytes
  forward_passes = 2 if recipe.remat != 'none' else 1
  ring = recipe.context_attention == 'ring'
  context_bytes = 0.0
  if c > 1:
    backward = (1 + 4 / compute_bytes) if ring else 1   # the fp32 gradients travel with them
    context_bytes = chunk_layers * m * (forward_passes + backward) * (c - 1) / c * kv
  context_comm = context_bytes / target.intra_node

  sharded = cfg.num_params / (t * P * (dp if zero_shards(recipe.zero_stage, 'optimizer') else 1))
  # Bytes of one moment per parameter: the policy's update dtype, or 8-bit codes and their scales.
  adam = StepShape(1, seq_len, adam_bits=recipe.adam_bits)
  moment = moment_bytes(cfg, policy, adam) / cfg.num_params
  # The weight and its gradient read and the weight written; the master read and written; both
  # moments read and written.
  touched = sharded * (3 * param_bytes + 2 * policy.master_bytes + 2 * 2 * moment)
  optimizer = touched / target.hbm
  # An offloaded state comes over from host memory and goes back, every step.
  host_bytes = 2 * sharded * (2 * moment + policy.master_bytes) if recipe.offload else 0
  host_transfer = host_bytes / target.host_link
  exposed_context = 0.0 if ring else context_comm
  total = (max(compute, dp_comm, context_comm if ring else 0.0) + tp_comm + pipeline_comm
           + exposed_context + optimizer + host_transfer)
  return {'compute': compute, 'data_parallel_comm': dp_comm, 'tensor_comm': tp_comm,
          'pipeline_comm': pipeline_comm, 'context_comm': context_comm, 'optimizer': optimizer,
          'host_transfer': host_transfer, 'total': total, 'host_bytes': host_bytes,
          # and the bytes behind the comm terms, per device per step
          'data_parallel_bytes': dp_bytes,
          'tensor_bytes': tp_bytes, 'pipeline_bytes': pipeline_bytes,
          'context_bytes': context_bytes}
