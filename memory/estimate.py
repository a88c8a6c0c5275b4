"""Analytic per-device memory of a train step: parameters, gradients, optimizer state, activations.

It predicts XLA's compiled figure for one device (arguments + outputs - donated + temp,
`memory.compiled`); `python -m bench.studies.memory_matrix [--large]` compares the two over layouts,
precisions, remat policies, Adam widths and microbatch counts, and `tests/test_estimate.py` pins
the agreement. Every term below was read off XLA's buffer assignment of such compiles (the
`--xla_dump_to` buffer-assignment and live-range dumps: which buffers are live at the peak).

Model state (the step's arguments, and the gradients, which live through the whole step):
- parameters are stored in the policy's param dtype, split `tensor` ways (tensor parallelism
  splits every matmul weight and the vocabulary; the norm scales it does not split are negligible)
  and `fsdp` ways under ZeRO-3;
- gradients have the parameters' size and dtype (they are accumulated in it), split `fsdp` ways
  under ZeRO-2 and 3; with microbatches the gradients of the microbatch in flight are a second
  copy beside the accumulator (in `temporaries`);
- AdamW keeps two moments of the same size, in the parameters' dtype or, with an fp32 master copy
  of 16-bit weights (precision/policy.py), in fp32 beside that copy (4 more bytes per value), all
  split `fsdp` ways under ZeRO-1, 2 and 3;
  with 8-bit moments, one byte per value (padded to whole blocks) plus an fp32 scale per block for
  every tensor of 4096 values or more (optim/adam8bit.py), split over the mesh axes of the
  parameter's first sharded dimension where they divide its blocks and whole on every device where
  they do not (train/state.py); smaller tensors keep fp32 moments.

The rest is the largest of four phases, each holding the gradients and whatever it adds:
- the head's backward pass (`activations`: the saved activations, the fp32 logits and their fp32
  gradient, the compute-dtype gradient the head's matmul takes (on XLA:CPU with bf16 compute an
  fp32 copy of it takes that place, counted once with the two) (for one chunk of positions with
  `model.loss_chunk`), and the final norm's four fp32
  d_model rows; `temporaries`: the vocabulary copies below);
- the layers' backward pass, one layer at a time (`activations`: the saved activations and the
  layer's working set below; `temporaries`: the layer's weight gradient, the vocabulary buffers
  still held);
- between the two on XLA:CPU with bf16 compute, the saved stacks' conversion to fp32
  (`stack_convert_bytes`: every stack in fp32, and the largest in the compute dtype as well);
- the optimizer update (`update`, counted only where it exceeds the larger backward phase): one
  fp32 buffer of the (optimizer-sharded) parameters' size between the moments and the new
  weights, plus, with 16-bit weights, a copy of the weights and moments as they are rewritten.
  8-bit Adam runs its whole chain (clipping, Adam, weight decay, learning rate) one slice of a
  tensor at a time and writes each slice's update over that slice's gradient
  (optim/adam8bit.py): what it adds is one slice's fp32 working set (the gradient, both moments
  and the update) of the largest tensor.

Saved activations, per token per layer (`saved_per_token_per_layer`). Without remat: 6 d_model rows
(4 fp32 inside the two RMSNorms, 2 normed outputs in the compute dtype), query and attention output
(heads x head_dim each), key and value (kv_heads x head_dim each), the fp32 attention scores and the
probabilities (heads x length each; with a fused attention, flash or cuDNN (models/attention.py),
the blocked copies of q, k, v and the output its kernel takes and an fp32 log-sum-exp per head
instead, nothing of length x length, and of the unblocked four only the output), 6 mlp_dim rows of
the SwiGLU. `full` keeps the residual
stream; `dots` also the outputs of the matmuls without batch dimensions (query, key, value, gate,
up) and one more d_model row; `qkv` the residual stream, query, key and value. Tensor parallelism
splits all but the d_model rows. The layers are scanned, so every layer's saved values are stacked
and stay allocated until the backward scan ends.

One layer's backward working set (`layer_backward_bytes`): a layer's worth of un-rematerialised
activations (the slices of the saved stacks, or under remat the recomputed forward values) at the
larger of two points: the MLP's (its rows, plus three fp32 mlp_dim gradients where they were
recomputed) or the attention's (the fp32 gradient of the probabilities; with a fused attention its
fp32 dq, dk, dv accumulators and one block pair's scores per row). Under tensor parallelism
the attention and MLP outputs exist twice, as partial sums and after their all-reduce. Where the
weights outweigh the activations (small batches) the peak is instead at the weights: the layer's
weights and their gradient (or under ZeRO-2/3 the gradient before and after its reduction).

The vocabulary (`vocab_bytes`): the head multiplies by an fp32 table that is not the parameter
(ZeRO-3's gathered copy, or XLA:CPU's copy of the compute-dtype cast). With sharded gradients
(ZeRO-2/3) the head's and the lookup's gradients exist full-size until their reduce-scatter, which
XLA places at the end of the backward pass. With microbatches, loop-invariant copies (gathered
tables, casts) are hoisted out of the microbatch loop and stay for the whole step.

XLA:CPU (`backend='cpu'`: the dry run and the simulated devices compile for it) in jax 0.10 has no
bf16 matmul (it has fp16 ones): it converts
the operands of every bf16 dot to fp32 (`upcasts`; jax 0.11's XLA:CPU multiplies in bf16, and
`cpu_upcasts_bf16` asks the installed compiler which it is). Because the converts of loop-invariant operands are hoisted
out of the layer scan, at the backward peak every saved activation is held in fp32, the stacked
layer weights get an fp32 copy (of the saved compute-dtype cast without remat, or of the weights
themselves when they are stored in bf16 and not gathered layer by layer), the attention backward
holds an fp32 copy of the probabilities, and recomputed bf16 values partly exist twice (taken as
the mean of the bf16 and fp32 sizes: the measured working set of bf16 layers is 0.8x the fp32
one). On a GPU those copies do not exist; `backend='gpu'` is the same model without them and with
XLA:GPU's own terms, read off its programs (`--dry_run --target`, `bench.buffers --target`; issue
46): the update fused in place, ZeRO-1/2's new weights formed whole (ZeRO-2's a stack at a time)
once the update has spent the gradients, the head's table in the compute dtype, the logits' gradient
and the tied head's in the compute dtype where the head's backward rounds it (models/loss.py), the
lookup's gradient formed after the layers' backward, gradients not formed yet at the head's peak
(`unformed_grads`; the whole layer gradients are, zero-filled, under remat full or where they
are summed over devices, but not under tensor parallelism), the head's weight-gradient point, two layers' weights in flight and the
transposed gradient stacks under ZeRO-3, the saved stacks once more under ZeRO-3's microbatches,
beside the gradients' sum a microbatch's own set (two under ZeRO-3; in a pipeline the stage's
carry is the second; none yet at the loss where the weights are not gathered), without remat the
quantized products' saved compute-dtype casts of the weights (a float product casts again in the
backward), a frozen table taken as stored, a recomputed layer and
tensor-parallel partial sums in the compute dtype, cuDNN's segment-mask bias and no block of
probabilities in its backward, ZeRO-2's update sets where the device has room for them, ZeRO-1's
second copies over padded shards (`sweeps/estimate.py:gpu`: 79 of its 90 points within 5 %;
WORKSPACE.md says why the others are not).

Not modelled, measured: quantized matmuls (`quant.mode`) have no terms of their own (on XLA:GPU,
once quant/matmul.py keeps their weight stacks untransposed, they hold what bf16 holds); they compile
within 3 % of this model, except int4 with learned scales (-10 %) and fp8 with delayed scaling
(-6 %); fp16 with loss scaling compiled 12-18 % above it when the overflow skip was a select (it
kept the old state, so the layer scans took their own copies of the stacked weights); 8-bit moments
under tensor parallelism, whose blocks XLA reshards, up to 12 % above at 7B (fsdp_tp) and 35-45 % at
tiny, state-dominated shapes. XLA's heap fragmentation is not modelled either: XLA:CPU's compiled
temp was within 1 % of the largest live set in every compile examined; XLA:GPU's was up to 13 %
above it at 64 and 512 devices (7b ZeRO-3 on 512 H100s: 3.64 GiB for a largest live set of 3.23).
"""
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import logical_to_mesh_axes

from memory.compiled import format_bytes
from models.attention import flash_block
from models.attention import resolve as resolve_attention
from models.config import ModelConfig
from models.llama import Transformer
from models.loss import head_gradient_rounded
from parallel.pipeline import BACKWARD_IN_LOOP
from parallel.stage_layers import LayerSplit
from parallel.rules import ZERO_AXES, layout_rules, mesh_axes, zero_shards
from parallel.sharding import logical_axes
from precision.policy import Policy, get_policy

FP32 = 4
QUANTIZED_MIN_SIZE = 4096   # optim/adam8bit.py: smaller tensors keep fp32 moments
UPDATE_SLICES = 16          # optim/adam8bit.py: a quantized moment is updated a sixteenth at a time


@dataclasses.dataclass(frozen=True)
class StepShape:
  rows_per_device: int   # sequences in one microbatch on one device
  seq_len: int
  fsdp: int = 1          # ways ZeRO splits the state: the mesh's fsdp x context axes
  tensor: int = 1        # size of the mesh's tensor axis
  zero_stage: int = 0
  microbatches: int = 1
  adam_bits: int = 32
  adam_block_size: int = 2048
  backend: str = 'cpu'   # the platform compiled for: 'cpu' adds XLA:CPU's fp32 copies (see above)
  stages: int = 1        # size of the mesh's stage axis (pipeline parallelism)
  pipeline_microbatches: int = 1   # what the pipeline splits one microbatch into
  repeats: int = 1       # layer chunks per stage (circular schedule)
  schedule: str = 'gpipe'   # parallel.pipeline_schedule: 1f1b ones run the backward in the loop
  gather_once: bool = False   # gpipe, circular: ZeRO-3's weights gathered before the loop
  chunk_layers: tuple[int, ...] = ()   # parallel.pipeline_stage_layers (): the default split
  offload_optimizer: bool = False   # master and moments in host memory (parallel.offload_optimizer)
  offload_frozen: bool = False      # a LoRA base in host memory (parallel.offload_frozen)
  update_on_host: bool = False      # the offloaded update computed by the host's processor
                                    # (parallel.offload_update='host'), not streamed
  context: int = 1       # size of the mesh's context axis: shards of each sequence
  data_parallel: int = 1   # devices each gradient is summed over: the data x fsdp x context axes
  packed: bool = False   # rows hold several documents (data.packing): attention takes a segment mask
  device_memory: float = 0   # bytes of one device compiled for (0: not known): XLA:GPU's schedule
                             # holds more where the device has room (`roomy_update_sets`)

  @property
  def backward_in_loop(self) -> bool:
    return self.stages > 1 and self.schedule in BACKWARD_IN_LOOP

  @property
  def pipeline_iterations(self) -> int:
    """Iterations of the pipeline loop (parallel/pipeline.py); 1 without a pipeline."""
    return self.pipeline_microbatches * self.repeats + self.stages - 1

  def layer_split(self, cfg: ModelConfig) -> LayerSplit:
    """Which layers each pipeline chunk runs (parallel/stage_layers.py)."""
    return LayerSplit.of(cfg.num_layers, self.stages, self.repeats, self.chunk_layers)

  def stage_layers(self, cfg: ModelConfig) -> int:
    """Layer slots a stage runs: its chunks', each as deep as the deepest chunk (num_layers /
    stages for an even split; num_layers without a pipeline)."""
    return self.repeats * self.layer_split(cfg).depth

  def layer_runs(self, cfg: ModelConfig) -> float:
    """Layer applications a stage keeps the activations of, per token of a microbatch: in a
    pipeline its chunk's slots at every iteration on 1/M of the rows, bubble included (gpipe)."""
    return (self.layer_split(cfg).depth * self.pipeline_iterations / self.pipeline_microbatches
            if self.stages > 1 else cfg.num_layers)

  def takes_layers(self, cfg: ModelConfig) -> bool:
    """A split of the layers other than their storage's blocks (given, or the default where the
    blocks would leave a chunk empty): each chunk's layers are taken out of the stored stack once
    per step (moved stage to stage: parallel/stage_layers.py)."""
    return self.stages > 1 and not self.layer_split(cfg).blocks

  def stage_params(self, cfg: ModelConfig) -> float:
    """Parameters one pipeline stage holds: the layers are stored over the stages in blocks of
    ceil(num_layers / stages), the vocabulary's tables split over them, the final norm on every
    stage."""
    layers = cfg.num_layers * cfg.params_per_layer
    vocab = cfg.embedding_params * _vocab_matrices(cfg)
    return (cfg.num_params - layers - vocab * (1 - 1 / self.stages)
            + -(-cfg.num_layers // self.stages) * cfg.params_per_layer)

  @property
  def vocab_ways(self) -> int:
    """Ways the vocabulary (the embedding's and head's tables, the logits) is split: over
    `tensor` and `stage` (parallel/rules.py)."""
    return self.tensor * self.stages

  def sharded(self, part: str) -> bool:
    """Whether `part` of the state ('params', 'grads', 'optimizer') is split over `fsdp`."""
    return zero_shards(self.zero_stage, part)

  def shards(self, part: str) -> int:
    """Ways `part` of the state is split: `tensor`, and `fsdp` where the ZeRO stage shards it."""
    return self.tensor * (self.fsdp if self.sharded(part) else 1)

  @property
  def tokens(self) -> int:
    """Tokens one device runs through the model per microbatch."""
    return self.rows_per_device * self.local_len

  @property
  def local_len(self) -> int:
    """Positions of a sequence on one device (its context shard's)."""
    return self.seq_len // self.context

  @property
  def gathers_params(self) -> bool:
    """ZeRO-3 over more than one device: weights are all-gathered where they are used."""
    return self.sharded('params') and self.fsdp > 1

  @property
  def scatters_grads(self) -> bool:
    """ZeRO-2/3 over more than one device: gradients are reduce-scattered into shards (on one
    device the program is DDP's)."""
    return self.sharded('grads') and self.fsdp > 1

  @property
  def gathers_once(self) -> bool:
    """ZeRO-3's weights of a pipeline stage gathered once per step, before its loop: always under
    the 1f1b schedules, under gpipe and circular with parallel.pipeline_gather_once."""
    return self.gathers_params and self.stages > 1 and (self.backward_in_loop or self.gather_once)

  @property
  def stage_whole(self) -> bool:
    """A gpipe or circular stage's layer weights gathered whole once per step, before its loop
    (parallel.pipeline_gather_once)."""
    return self.gathers_once and not self.backward_in_loop


def on_gpu(shape: 'StepShape') -> bool:
  """Whether the step is compiled by XLA:GPU (`--target`, or a GPU's own devices)."""
  return shape.backend == 'gpu'


def upcasts(policy: Policy, backend: str) -> bool:
  """Whether the compiler converts the operands of bf16 matmuls to fp32: XLA:CPU up to jax 0.10
  (it had fp16 matmuls, not bf16 ones); see cpu_upcasts_bf16."""
  return (backend == 'cpu' and jnp.dtype(policy.compute_dtype) == jnp.bfloat16
          and cpu_upcasts_bf16())


@functools.cache
def cpu_upcasts_bf16() -> bool:
  """Asks the installed XLA:CPU: compiles a bf16 x bf16 matmul and reads whether the product
  runs in fp32 (jax 0.10: it converts both operands) or in bf16 (jax 0.11). Compiling needs no
  allocation and takes milliseconds; the answer is the compiler's, not a version table's."""
  cpu = jax.devices('cpu')[0]
  # A model-sized product: jax 0.11 still converts tiny ones (4 x 4) to fp32.
  operand = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16,
                                 sharding=jax.sharding.SingleDeviceSharding(cpu))
  text = jax.jit(lambda a, b: a @ b).lower(operand, operand).compile().as_text()
  dots = [line for line in text.splitlines() if ' dot(' in line]
  return bool(dots) and all('= f32[' in line for line in dots)


def saved_per_token_per_layer(cfg: ModelConfig, policy: Policy, seq_len: int, tensor: int = 1,
                              remat: str = 'none', backend: str = 'cpu',
                              platform: str | None = None) -> dict[str, float]:
  """Bytes one token leaves behind in one layer for the backward pass under `remat`. `platform`:
  the one compiled for, where `backend` stands for another's dtypes (default: `backend`)."""
  platform = platform or backend
  c = FP32 if upcasts(policy, backend) else policy.compute_bytes   # XLA:CPU holds them in fp32
  d, hd = cfg.d_model, cfg.head_dim
  q, kv = cfg.num_heads * hd / tensor, cfg.num_kv_heads * hd / tensor
  mlp = cfg.mlp_dim / tensor
  if remat == 'none':
    # A fused attention's backward reads its own blocked copies (in attention_scores), so of
    # query, key, value and output only the output stays, the output projection's input (small
    # preset, fp32, flash, one device, bench/buffers.py: the saved stacks hold no other).
    fused = fused_attention(cfg, policy, backend)
    # The two norms' inputs and outputs; autodiff keeps the inputs and normed values in fp32, the
    # custom backward of RMSNorm off the CPU only the inputs and a number per row
    # (models/rmsnorm.py: 1b on one H200, 52.55 -> 46.55 GiB compiled).
    norms = (4 * d * c + 2 * FP32 if platform != 'cpu' and cfg.norm == 'rms'
             else 4 * d * FP32 + 2 * d * c)
    return {
        'residual_and_norms': norms,
        'qkv': (q if fused else 2 * q + 2 * kv) * c,       # query, key, value, attention output
        'attention_scores': _attention_saved(cfg, policy, seq_len, tensor, backend),
        # SwiGLU's gate, up and their products; off the CPU its product keeps only the gate and
        # up, and the down projection its input (models/swiglu.py: 1b on one H200, 68.50 -> 56.50
        # GiB compiled).
        'mlp': (3 if platform != 'cpu' and cfg.mlp == 'swiglu' else 6) * mlp * c,
    }
  kept = {
      'full': {'residual_and_norms': d * c},
      'dots': {'residual_and_norms': 2 * d * c, 'qkv': (q + 2 * kv) * c, 'mlp': 2 * mlp * c},
      'qkv': {'residual_and_norms': d * c, 'qkv': (q + 2 * kv) * c},
  }
  return kept[remat]


def fused_attention(cfg: ModelConfig, policy: Policy, backend: str) -> bool:
  """Whether the attention never holds a [length, length] block (flash, cuDNN)."""
  return resolve_attention(cfg.attention, policy.compute_dtype, backend) != 'xla'


def _attention_saved(cfg: ModelConfig, policy: Policy, seq_len: int, tensor: int,
                     backend: str) -> float:
  """Bytes per token the attention itself keeps for its backward pass, besides q, k, v and its
  output: the fp32 scores and the probabilities (xla), or the blocked copies of q, k, v and the
  output that the fused kernel takes, and its fp32 log-sum-exp per row (flash, cuDNN)."""
  c = FP32 if upcasts(policy, backend) else policy.compute_bytes
  heads = cfg.num_heads / tensor
  if not fused_attention(cfg, policy, backend):
    return heads * seq_len * (FP32 + c)
  q, kv = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim / tensor
  return (2 * q + 2 * kv) * c + heads * FP32


def _attention_backward(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Bytes per token at the attention's backward peak, beyond the recomputed forward values.
  xla: the fp32 gradient of the probabilities, and the fp32 probabilities where they were
  recomputed or where the CPU copies them for its matmuls (bf16 compute on jax 0.10).
  Flash: fp32 accumulators of dq, dk and dv and the output gradient in the blocked layout, and
  per row of the batch one block pair's fp32 probabilities, their gradient and the scores' gradient (a flash block squared, three times per query head:
  measured at the tiny preset with two blocks, where they are a large part of the step).
  cuDNN: its backward kernel (`__cudnn$fmhaScaleBiasSoftmaxBackward` in XLA:GPU's program)
  takes the output, its gradient and the fp32 log-sum-exp and returns dq, dk and dv in the
  compute dtype beside an empty workspace: the probabilities never leave the chip, so no block
  of them is a buffer (100m ZeRO-3 x tensor 4 on 8, 64 and 512 H100s, sweeps/estimate.py:gpu:
  +5.6, +12.5 and +15.9 % with the flash kernel's blocks counted, -1.2, -4.5 and -5.1 % without).
  Over packed rows it also returns the additive mask's gradient, [length, length] per row, not
  counted: no point read has its peak at the attention's backward (the MLP's at 100m, the
  head's at 7b on 32k tokens)."""
  heads = cfg.num_heads / shape.tensor
  if not fused_attention(cfg, policy, shape.backend):
    # Without remat the probabilities are slices of the saved stack (counted there) unless the
    # CPU takes an fp32 copy of them; recomputed, they are here in fp32 beside their gradient.
    copies = 2 if upcasts(policy, shape.backend) or cfg.remat != 'none' else 1
    return copies * heads * shape.seq_len * FP32
  c = FP32 if upcasts(policy, shape.backend) else policy.compute_bytes
  q, kv = heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim / shape.tensor
  if resolve_attention(cfg.attention, policy.compute_dtype, shape.backend) == 'cudnn':
    # dq, dk and dv; the output and its gradient; the log-sum-exp per head.
    return (q + 2 * kv) * c + 2 * q * c + heads * FP32
  block = (context_block(shape) if shape.context > 1
           else min(flash_block(shape.backend), shape.seq_len))
  per_row_block = 3 * heads * block * block * FP32
  return (q + 2 * kv) * FP32 + q * c + heads * FP32 + per_row_block / shape.local_len


def context_block(shape: StepShape) -> int:
  """The flash block of the context-parallel attention (models/context.py:block_size)."""
  return math.gcd(shape.seq_len // (2 * shape.context), flash_block(shape.backend))


def context_collective_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> dict:
  """Bytes per device per step that the context-parallel attention moves (models/context.py),
  counted as parallel/collectives.py counts them. `gather`: the gathered keys and values of every
  layer's forward pass (and again where remat recomputes it), and the reduce-scatter of their
  gradients in the backward pass, each the whole sequence's [rows, length, kv_heads / tensor,
  head_dim]. `ring`: the collective-permutes of the shard's keys and values, shards - 1 in each
  forward pass, and `shards` in the backward pass with their fp32 gradients beside them (packed
  rows' segment ids travel too: 4 bytes a position, not counted)."""
  kinds = {'all-gather': 0.0, 'reduce-scatter': 0.0, 'collective-permute': 0.0}
  if shape.context == 1:
    return kinds
  pair = 2 * shape.rows_per_device * shape.seq_len * cfg.num_kv_heads * cfg.head_dim / shape.tensor
  passes = 1 if cfg.remat == 'none' else 2
  layers = cfg.num_layers * shape.microbatches
  c = policy.compute_bytes
  if cfg.context_attention == 'ring':
    local = pair / shape.context
    kinds['collective-permute'] = layers * local * (
        passes * (shape.context - 1) * c + shape.context * (c + FP32))
    return kinds
  return {**kinds, 'all-gather': passes * layers * pair * c, 'reduce-scatter': layers * pair * c}


def _vocab_matrices(cfg: ModelConfig) -> int:
  return 1 if cfg.tie_embeddings else 2


@functools.cache
def _param_tensors(cfg: ModelConfig) -> tuple[tuple[tuple, tuple], ...]:
  """(shape, logical axes) of each parameter tensor of the model as it is built (abstractly:
  nothing is allocated), whatever its block: SwiGLU or GELU, RMSNorm or LayerNorm, biases,
  learned positions, tied or untied head."""
  model = nnx.eval_shape(lambda: Transformer(cfg, policy=get_policy('fp32'),
                                             rngs=nnx.Rngs(params=0)))
  variables = jax.tree.leaves(nnx.state(model, nnx.Param),
                              is_leaf=lambda x: isinstance(x, nnx.Variable))
  return tuple((tuple(v.shape), logical_axes(v)) for v in variables)


def param_leaves(cfg: ModelConfig, shape: StepShape) -> list[tuple[int, int]]:
  """(values, ways) of each parameter tensor as stored (the layers stacked on a leading axis):
  `ways` is how many ways its 8-bit moments split, the mesh axes of the parameter's first sharded
  dimension in the optimizer's layout (train/state.py blocks the moments from that dimension)."""
  sizes = {'fsdp': shape.fsdp, 'tensor': shape.tensor, 'stage': shape.stages}
  rules = layout_rules(shape.zero_stage).optimizer
  leaves = []
  for dims, axes in _param_tensors(cfg):
    ways = [math.prod(sizes.get(a, 1) for a in mesh_axes(part))
            for part in logical_to_mesh_axes(axes, rules)]
    leaves.append((math.prod(dims), next((w for w in ways if w > 1), 1)))
  return leaves


@functools.cache
def padding_ratio(cfg: ModelConfig, fsdp: int) -> float:
  """Stored values over the model's values for state split `fsdp` ways by the ZeRO rules: a
  dimension that `fsdp` does not divide is stored padded to the next multiple (parallel/padding.py;
  100m's d_model 768 on 512 devices: 1024, 4/3 of every weight). XLA gathers such a weight at its
  padded size too, so the gathered weights of ZeRO-3 carry the same ratio (100m on 512 devices,
  bench/buffers.py: the MLP's weights gathered as [1024, 3072])."""
  stored = values = 0
  for dims, axes in _param_tensors(cfg):
    stored += math.prod(_padded(dims, axes, fsdp))
    values += math.prod(dims)
  return stored / values


def uneven(cfg: ModelConfig, fsdp: int) -> bool:
  """Whether `fsdp` leaves some stored dimension padded (it does not divide d_model)."""
  return padding_ratio(cfg, fsdp) > 1


def _padded(dims: tuple, axes: tuple, fsdp: int) -> list[int]:
  """A parameter's dimensions as the ZeRO rules store them split `fsdp` ways: each that the ZeRO
  axes split padded to the next multiple of `fsdp` (parallel/padding.py)."""
  spec = tuple(logical_to_mesh_axes(axes, layout_rules(3).params)) + (None,) * len(dims)
  return [-(-n // fsdp) * fsdp if set(mesh_axes(part)) & set(ZERO_AXES) else n
          for n, part in zip(dims, spec)]


def shards(cfg: ModelConfig, shape: StepShape, part: str) -> float:
  """Ways a piece of state is split (`shape.shards`), less the padding that an uneven split over
  `fsdp` stores (`padding_ratio`)."""
  ways = shape.shards(part)
  return ways / padding_ratio(cfg, shape.fsdp) if shape.sharded(part) else ways


def gathered(cfg: ModelConfig, shape: StepShape) -> float:
  """What a weight all-gathered by ZeRO-3 takes per value of the model: its padding included."""
  return padding_ratio(cfg, shape.fsdp) if shape.gathers_params else 1.0


def param_leaf_sizes(cfg: ModelConfig) -> list[int]:
  """Values in each parameter tensor as stored (the layers stacked on a leading axis)."""
  return [n for n, _ in param_leaves(cfg, StepShape(rows_per_device=1, seq_len=1))]


def moment_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Bytes of one Adam moment for the whole model."""
  if shape.adam_bits == 32:
    return cfg.num_params * policy.moment_bytes
  total = 0
  for n in param_leaf_sizes(cfg):
    if n >= QUANTIZED_MIN_SIZE:
      blocks = math.ceil(n / shape.adam_block_size)
      total += blocks * shape.adam_block_size + blocks * FP32   # codes, padded; a scale per block
    else:
      total += n * FP32
  return total


def _moment_ways(n: int, ways: int, shape: StepShape) -> int:
  """Ways an 8-bit moment of n values is split: its blocks go over `ways` where they divide
  evenly, and stay whole on every device where they do not (train/state.py)."""
  return ways if math.ceil(n / shape.adam_block_size) % ways == 0 else 1


def optimizer_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Bytes of both Adam moments (and the master copy, where the policy keeps one) on one device."""
  master = shape.stage_params(cfg) * policy.master_bytes / shards(cfg, shape, 'optimizer')
  if shape.adam_bits == 32:
    return master + 2 * shape.stage_params(cfg) * policy.moment_bytes / shards(cfg, shape, 'optimizer')
  return master + 2 * sum(eight_bit_moment(cfg, shape))


def eight_bit_moment(cfg: ModelConfig, shape: StepShape) -> tuple[float, float]:
  """One 8-bit moment on one device: (its codes, a byte per value padded to whole blocks; the
  rest: an fp32 scale per block, and the tensors too small to quantize, kept in fp32)."""
  codes = rest = 0
  for n, ways in param_leaves(cfg, shape):
    if n >= QUANTIZED_MIN_SIZE:
      blocks = math.ceil(n / shape.adam_block_size)
      codes += blocks * shape.adam_block_size / _moment_ways(n, ways, shape)
      rest += blocks * FP32 / _moment_ways(n, ways, shape)
    else:
      rest += n * FP32 / ways
  return codes, rest


def activation_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """The activations every layer saves for the backward pass (stacked over layers). In a
  pipeline, a stage runs its layers on 1/M of the rows at every iteration, bubble included
  (gpipe); circular keeps less (below)."""
  saved = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, cfg.remat,
                                    shape.backend)
  if shape.repeats > 1:
    # Circular: a chunk's forward is recomputed in the backward pass, so each iteration keeps only
    # its input (a d_model row per token), and one chunk's saved activations exist at a time: all
    # but the layer whose backward runs, which the layer's working set counts (as 1f1b's chunk).
    c = FP32 if upcasts(policy, shape.backend) else policy.compute_bytes
    per_iteration = shape.tokens / shape.pipeline_microbatches
    return per_iteration * (shape.pipeline_iterations * cfg.d_model * c
                            + (shape.layer_split(cfg).depth - 1) * sum(saved.values()))
  return shape.tokens * shape.layer_runs(cfg) * sum(saved.values())


def pipeline_ring_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """A stage's ring of activation slots (parallel/pipeline.py: the batch's M microbatches, the
  last stage's M outputs, a spare), or in the backward pass its gradient."""
  if shape.stages == 1:
    return 0
  M = shape.pipeline_microbatches
  return (2 * M + 1) * shape.tokens / M * cfg.d_model * policy.compute_bytes


def layer_backward_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape,
                         trains_weights: bool = True) -> dict[str, float]:
  """One layer's backward working set: activation-shaped buffers and weight-shaped ones.

  The activations are one layer's un-rematerialised set (the slices of the saved stacks, or under
  remat the recomputed forward values) plus the gradients being formed, at whichever point of the
  layer's backward holds more: the MLP's (the SwiGLU rows, and three fp32 gradients of mlp_dim
  where they were recomputed) or the attention's (the gradient of the probabilities)."""
  if on_gpu(shape) and cfg.remat == 'full' and fused_attention(cfg, policy, shape.backend):
    return gpu_recomputed_layer(cfg, policy, shape, trains_weights)
  if cfg.remat == 'none' or not upcasts(policy, shape.backend):
    layer = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, 'none',
                                      shape.backend)
  else:
    # Recomputed in bf16, without the fp32 copies of matmul operands that the CPU keeps in the
    # saved stacks: since the dense products run as 2-D matmuls with their own backward
    # (quant/contraction.py), none stays beside the recomputed values at the layer's backward
    # peak (measured, tiny fsdp bf16_mixed remat=full, 1024 positions in 64-position flash
    # blocks: compiled 8.39 MB; this estimate -5.7 %, with half of them counted +14.6 %).
    layer = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, 'none', 'gpu',
                                      platform=shape.backend)
  if cfg.remat != 'none':
    # Recomputed, the forward pass makes the unblocked query, key and value again on the way.
    q = cfg.num_heads * cfg.head_dim / shape.tensor
    kv = cfg.num_kv_heads * cfg.head_dim / shape.tensor
    layer['qkv'] = (2 * q + 2 * kv) * policy.compute_bytes
  if cfg.remat != 'none' and not fused_attention(cfg, policy, shape.backend):
    # Recomputed, the scores come out of their matmul in fp32 and the probabilities are rounded
    # to 16 bits only as the operand of a matmul: the fp32 probabilities are counted at the
    # attention's backward point, and no 16-bit copy stays.
    layer['attention_scores'] = cfg.num_heads * shape.seq_len * FP32 / shape.tensor
  common = layer['residual_and_norms'] + layer['qkv'] + layer['attention_scores']
  if shape.tensor > 1:   # the attention and MLP outputs as partial sums and after their all-reduce
    # (XLA:GPU keeps them in the compute dtype: `gpu_recomputed_layer`)
    common += 2 * cfg.d_model * (policy.compute_bytes if on_gpu(shape) else FP32)
  # Where the MLP's matmul outputs are recomputed (remat full, qkv), its three fp32 gradients of
  # mlp_dim come on top of the recomputed values; where they are saved (no remat, dots), the
  # gradients take the place of the slices of the saved stacks already consumed.
  recomputed_mlp = cfg.remat in ('full', 'qkv')
  mlp_point = layer['mlp'] + (3 * cfg.mlp_dim / shape.tensor * FP32 if recomputed_mlp else 0)
  attention_point = _attention_backward(cfg, policy, shape)
  weights = (cfg.attention_params_per_layer + cfg.mlp_params_per_layer) / shape.tensor
  # The layer's weight gradient (fp32 on CPU, where bf16 matmuls run in fp32).
  weight_bytes = FP32 if upcasts(policy, shape.backend) else policy.param_bytes
  # Under ZeRO-3 the layer's weights are gathered twice around this point (for the recomputed
  # forward and for the backward), at their padded size where `fsdp` splits d_model unevenly, and
  # XLA keeps between one and two sets of them at the peak (100m on 512 devices, bench/buffers.py:
  # four [1024, 3072] gathered MLP weights and four attention ones; beside them two unpadded fp32
  # copies on jax 0.10.2, one on 0.12.0.1). One and a half sets' padding on top of the one set
  # counted: compiled 0.1255 / 0.1080 GiB, estimate -4.2 / +3.2 % (jax 0.10.2 / 0.12.0.1); on 256
  # devices, where 768 divides, there is no padding and the estimate is -0.1 / +0.6 %.
  padding = 1.5 * (gathered(cfg, shape) - 1)
  return {'activations': shape.tokens * (common + max(mlp_point, attention_point))
                         + context_kv_bytes(cfg, policy, shape),
          'weights': weights * weight_bytes * (1 + padding)}


def gpu_recomputed_layer(cfg: ModelConfig, policy: Policy, shape: StepShape,
                         trains_weights: bool = True) -> dict[str, float]:
  """A recomputed layer's backward on XLA:GPU (remat full, a fused attention): every value in the
  compute dtype, the norms' fp32 rows and the activations' gradients fused away. At the MLP's
  backward: three mlp_dim rows (the gate and up products and a gradient), seven d_model rows (the
  layer input, the normed inputs, the attention output, the residual gradients), query, key and
  value, and two d_model boolean rows (the norms' masks); one layer's weights in the compute dtype
  (gathered, dequantized or cast) and, where they train, their gradient (7b QLoRA on one H100,
  `model.loss_chunk` small so that the layer is the peak, bench.buffers --target: 2.70 GiB beside
  the saved stack, 16,384 tokens). A frozen base (`trains_weights` False) has no gradient: 20b
  QLoRA on one H100, bench.buffers --target: one layer's kernels dequantized to bf16, 0.73 GiB,
  and nothing weight-shaped besides."""
  c = policy.compute_bytes
  q = cfg.num_heads * cfg.head_dim / shape.tensor
  kv = cfg.num_kv_heads * cfg.head_dim / shape.tensor
  mlp_point = c * (3 * cfg.mlp_dim / shape.tensor + 7 * cfg.d_model + q + 2 * kv) + 2 * cfg.d_model
  # At long sequences the attention's backward holds more (its fp32 accumulators: see
  # `_attention_backward`) beside the layer's d_model rows and query, key and value.
  attention_point = c * (5 * cfg.d_model + q + 2 * kv) + _attention_backward(cfg, policy, shape)
  per_token = max(mlp_point, attention_point)
  if shape.tensor > 1:   # the attention and MLP outputs as partial sums and after their all-reduce,
    # in the compute dtype (7b ZeRO-3 x tensor 4 on 64 H100s, bench.buffers --target: bf16
    # [tokens, d_model] products at the attention's backward, no fp32 one)
    per_token += 2 * cfg.d_model * c
  weights = (cfg.attention_params_per_layer + cfg.mlp_params_per_layer) / shape.tensor
  mask = 0
  if shape.packed and resolve_attention(cfg.attention, policy.compute_dtype, 'gpu') == 'cudnn':
    # cuDNN takes packed rows' segment mask as an additive [length, length] bias per row, beside
    # the boolean mask it is made from (7b at 32k on 8 H100s, bench.buffers --target: a
    # bf16[1, 1, 32768, 32768] bias and its select at the attention's backward, 4 GiB).
    mask = 2 * shape.rows_per_device * shape.local_len ** 2 * c
  return {'activations': shape.tokens * per_token + mask + context_kv_bytes(cfg, policy, shape),
          'weights': weights * (c * gathered(cfg, shape)
                                + (policy.param_bytes if trains_weights else 0))}


def context_kv_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """What the context-parallel attention holds at a layer's backward pass (models/context.py):
  `gather`, the whole sequence's keys and values and their fp32 gradients before the
  reduce-scatter; `ring`, the shard's keys and values arriving beside those it computes with, and
  the fp32 gradients travelling with them (7b at 32k on 2 and 8 shards, `bench.studies.context
  --context_attention=ring`: counting the running sums and the arriving gradients apart put the
  estimate at +4.9 and +2.5 %, one fp32 pair +3.1 and +1.8 %)."""
  if shape.context == 1:
    return 0.0
  c = FP32 if upcasts(policy, shape.backend) else policy.compute_bytes
  kv = cfg.num_kv_heads * cfg.head_dim / shape.tensor
  if cfg.context_attention == 'ring':
    return shape.tokens * kv * 2 * (c + FP32)
  return shape.rows_per_device * shape.seq_len * kv * 2 * (c + FP32)


def layer_phase_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape,
                      trains_weights: bool = True) -> dict[str, float]:
  """The layer backward's peak: where its activations peak (with one layer's weight gradient),
  or where its weights do (the weights and their gradient, or under ZeRO-2/3 the gradient before
  and after its reduction), whichever is larger. A frozen base on XLA:GPU (`trains_weights`
  False): the weights alone, beside the activations."""
  trains_weights = trains_weights or not on_gpu(shape)
  layer = layer_backward_bytes(cfg, policy, shape, trains_weights)
  if layer['activations'] >= layer['weights'] or not trains_weights:
    return layer
  return {'activations': 0, 'weights': 2 * layer['weights']}


def stack_convert_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """XLA:CPU with bf16 matmuls run in fp32: the saved stacks' fp32 copies are made in one convert
  each, hoisted out of the backward layer scan, so while one runs that stack exists in the compute
  dtype and in fp32 at once; the stacks converted before it are fp32 only. At the last convert:
  every stack in fp32 (the saved activations) and the largest one, a row per token and layer, in
  the compute dtype as well (70b ZeRO-3 x 4-way tensor on 8 devices, remat full, bench/buffers.py:
  the bf16 residual stack, 20 GiB, beside its 40 GiB fp32 copy; 7b ZeRO-3 x tensor 2 without
  remat: one of the six MLP stacks, the rest fp32 already)."""
  if not upcasts(policy, shape.backend) or shape.repeats > 1:
    return 0
  q = cfg.num_heads * cfg.head_dim / shape.tensor
  mlp = cfg.mlp_dim / shape.tensor
  rows = {'none': (cfg.d_model, q, mlp), 'dots': (cfg.d_model, q, mlp),
          'qkv': (cfg.d_model, q), 'full': (cfg.d_model,)}[cfg.remat]
  return shape.tokens * shape.layer_runs(cfg) * max(rows) * policy.compute_bytes


def cpu_weight_copies(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """XLA:CPU's fp32 copy of the stacked layer weights, converted once for the whole stack (the
  convert of a loop-invariant operand is hoisted out of the layer scan), where the matmuls run in
  bf16: of the weights themselves when they are stored in bf16 and neither gathered nor split
  layer by layer (under tensor parallelism XLA was seen to convert inside the scan; for ZeRO-3's
  gathered weights see `cpu_shard_copies`), or else, without remat, of the bf16 cast that the
  forward pass saved for the backward."""
  if not upcasts(policy, shape.backend):
    return 0
  weights = shape.stage_layers(cfg) * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer)
  if policy.param_bytes < FP32 and not shape.gathers_params and shape.tensor == 1:
    return weights * FP32
  if cfg.remat == 'none':
    return weights * FP32 / shards(cfg, shape, 'params')
  return 0


def gpu_saved_weight_casts(cfg: ModelConfig, policy: Policy, shape: StepShape,
                           frozen: 'Frozen | None' = None) -> float:
  """XLA:GPU without remat: the forward saves each layer's compute-dtype cast of its stored
  weights for the backward, stacked over the layers like the activations, where the weights are
  stored wider than the compute dtype and not gathered layer by layer (7b ZeRO-2 without remat in
  4 microbatches on 8 A100s, the planner's pick, bench.buffers --target: the forward scan's
  bf16 [32, 4096, 11008] x 3 and [32, 4096, 4096]-sized x 4 stacks, 12.06 GiB, -12.0 % without
  them; 1b on one H200: bf16 [16, 2048, 8192] x 3 beside the activations). The float product
  casts them again in the backward instead (models/dense.py:weight_casts_recomputed: the 1b step
  46.55 -> 44.73 GiB), so only the quantized products, which quantize the cast, keep them."""
  if (not on_gpu(shape) or cfg.remat != 'none' or shape.gathers_params or frozen is not None
      or policy.param_bytes <= policy.compute_bytes or policy.matmul.product == 'none'):
    return 0
  weights = shape.stage_layers(cfg) * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer)
  return weights * policy.compute_bytes / shards(cfg, shape, 'params')


def cpu_shard_copies(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Under ZeRO-3, XLA:CPU converts the shards of layer weights stored in bf16 to fp32 whole,
  before the layer scan gathers them, and keeps the copies through the layers' backward pass (not
  in the head's, which comes before): 70b bf16_master ZeRO-3 on 64 devices, 4.0 GiB of fp32 shards
  beside the saved stacks' conversion; 7b LoRA's frozen base on 8 devices, 3.0 GiB at the layer
  peak (bench/buffers.py)."""
  if (not upcasts(policy, shape.backend) or policy.param_bytes >= FP32
      or not shape.gathers_params or shape.tensor > 1):
    return 0
  weights = shape.stage_layers(cfg) * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer)
  return weights * FP32 / shards(cfg, shape, 'params')


def vocab_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape,
                embedding_grads: bool = True) -> dict[str, float]:
  """Full-size vocabulary buffers besides the state: in the head's backward pass, and the ones
  still held while the layers run backward. `embedding_grads` False: a frozen table and head
  (LoRA) have no gradients to hold."""
  table = cfg.embedding_params * FP32 / shape.vocab_ways * gathered(cfg, shape)
  cpu_bf16 = upcasts(policy, shape.backend)
  # The head multiplies by an fp32 table that is not the parameter: gathered, or the CPU's copy.
  # XLA:CPU makes that copy on jax 0.11/0.12 too, which run other bf16 matmuls in bf16: the
  # head's contraction over the table's second dimension still takes fp32 operands (1b ZeRO-1 on
  # 8 devices, jax 0.12.0.1, bench/buffers.py: an f32[128256, 2048] convert at the peak).
  cpu_head_copy = shape.backend == 'cpu' and jnp.dtype(policy.compute_dtype) == jnp.bfloat16
  table_copy = int(shape.gathers_params or cpu_bf16 or cpu_head_copy)
  if on_gpu(shape):
    # XLA:GPU gathers (ZeRO-3) and casts the table in the compute dtype: one compute-dtype copy
    # where the head's operand is not the parameter itself (1b on 8 H100s, bench.buffers
    # --target: a bf16[128256, 2048] gather under ZeRO-3, a convert of the fp32 table under DDP).
    table_copy = policy.compute_bytes / FP32 * int(
        shape.gathers_params or policy.param_bytes > policy.compute_bytes)
  # With sharded gradients, the head's and the lookup's full-size gradients wait for their
  # reduce-scatter (see `held`); XLA:GPU forms them after the head's backward peak.
  full_grads = int(shape.scatters_grads and embedding_grads)
  head_grads = 0 if on_gpu(shape) else full_grads
  # A tied head's full-size gradient, which waits for the lookup's to be summed with it. With 16-bit
  # compute on XLA:GPU it is formed in the compute dtype from the rounded logits' gradient, in every
  # layout (1b ZeRO-3 on 8 H100s, bench.buffers --target: a bf16 [vocabulary, d_model] through the
  # layers' backward, the fp32 lookup gradient formed after them; under ZeRO-1 all-reduced beside
  # the full fp32 gradients); otherwise where the gradients are sharded, in the parameters' dtype.
  rounded = on_gpu(shape) and head_gradient_rounded(policy.compute_dtype, shape.backend)
  tied_grad = int(cfg.tie_embeddings and embedding_grads) * (
      policy.compute_bytes / FP32 if rounded else
      full_grads * (policy.param_bytes / FP32 if on_gpu(shape) else 1))
  if on_gpu(shape):   # in the parameters' dtype (XLA:CPU upcasts 16-bit ones)
    full_grads *= policy.param_bytes / FP32
  # With microbatches, loop-invariant copies are hoisted out of the microbatch loop and stay for
  # the whole step. Under ZeRO-3: the gathered tables, i.e. the lookup's and the head's, and on CPU
  # with bf16 compute the head's as an fp32 copy of its cast and a bf16 one in the transposed
  # layout its matmul takes (1b ZeRO-3, 4 microbatches, bench/buffers.py; a tied table stored in
  # bf16 shares the lookup's copy). Otherwise the fp32 copy
  # of the head's cast (CPU, bf16 compute).
  hoisted = 0
  if shape.microbatches > 1:
    if shape.gathers_params and cpu_bf16:
      hoisted = (2 + policy.compute_bytes / FP32
                 - int(cfg.tie_embeddings and policy.param_bytes < FP32))
    elif shape.gathers_params:   # XLA:GPU gathers them in the compute dtype (1b ZeRO-3, 4
      # microbatches, on 8 H100s, bench.buffers --target: one bf16 [vocabulary, d_model] table)
      hoisted = _vocab_matrices(cfg) * (policy.compute_bytes / FP32 if on_gpu(shape) else 1)
    else:   # on one tensor shard a tied table is also laid out transposed for the head
      hoisted = int(cpu_bf16) * (1 + int(cfg.tie_embeddings and shape.tensor == 1))
  # ZeRO-3 with fp32 weights and bf16 compute on XLA:CPU: the forward's bf16 cast of the gathered
  # table leaves its slot in XLA's heap under the saved stacks' fp32 copies, which outlive it, so
  # the head's backward buffers are placed above it (1b ZeRO-3 on 8 and 64 devices,
  # bench/buffers.py: temp 0.55 GiB above the largest live set, the cast's 0.49 GiB and its
  # neighbours).
  cast_slot = (policy.compute_bytes / FP32 if shape.gathers_params and cpu_bf16
               and policy.param_bytes > policy.compute_bytes and cfg.remat != 'none' else 0)
  head = (max(table_copy, hoisted) + head_grads + cast_slot) * table
  # Held through the layers' backward: the lookup's gradient, and a tied table's head gradient,
  # which waits to be summed with it; an untied head's is reduced as soon as it is formed (7b
  # ZeRO-3 on 64 devices, bench/buffers.py: one [32000, 4096] fp32 gradient at the layer peak).
  # XLA:GPU forms the lookup's gradient after the layers' backward.
  held = (hoisted + (0 if on_gpu(shape) else full_grads) + tied_grad) * table
  # At the end of the backward pass the two full-size gradients are summed and reduced (on CPU an
  # all-reduce, then each device keeps its slice), its input and output beside them; XLA:GPU
  # reduce-scatters the sum into a shard (1b ZeRO-3 on 8 H100s: its peak is the head's).
  reduction = (hoisted + (full_grads + tied_grad if rounded else
                          2 * full_grads if on_gpu(shape) else 4 * full_grads)) * table
  # The fp32 logits and their gradient, for the whole sequence, or with `model.loss_chunk` for one
  # chunk of positions at a time. No compute-dtype copy of the gradient beside them: XLA:CPU with
  # bf16 compute gives the head's matmul an fp32 copy of it (laid out transposed) in place of the
  # 16-bit one (1b ZeRO-2 on 8 devices, bench/buffers.py: the gradient and its transposed copy,
  # no bf16 one; jax 0.10 and 0.12 alike). Where the head's gradient is rounded, XLA:GPU casts the
  # logits' gradient in the fusion that forms it (models/loss.py:cross_entropy): the fp32 logits
  # beside a compute-dtype gradient (1b ZeRO-3 on 8 H100s, bench.buffers --target).
  chunked = 0 < cfg.loss_chunk < shape.local_len
  logit_tokens = shape.rows_per_device * cfg.loss_chunk if chunked else shape.tokens
  # Unrounded, XLA:GPU writes the fp32 gradient over the logits (1b ZeRO-3 in fp32 on 8 H100s: one
  # fp32 [tokens, vocabulary] buffer at the head's backward).
  logits = logit_tokens * cfg.vocab_size / shape.vocab_ways * (
      FP32 + (policy.compute_bytes if rounded else 0 if on_gpu(shape) else FP32))
  # The final norm's input and output and their gradients, fp32; on XLA:GPU, which fuses the norm's
  # fp32 arithmetic, its input and output in the compute dtype (1b ZeRO-3 on 8 H100s, 20b QLoRA,
  # bench.buffers --target: two [tokens, d_model] rows at the head's backward, none fp32).
  logits += shape.tokens * cfg.d_model * (2 * policy.compute_bytes if on_gpu(shape) else 4 * FP32)
  # The head's weight gradient formed from the logits' gradient, in the compute dtype where it is
  # rounded (the table the head multiplied by still beside it), else fp32.
  weight = (logit_tokens * cfg.vocab_size / shape.vocab_ways * (policy.compute_bytes if rounded else FP32)
            + (max(0, table_copy - hoisted) * table if rounded else 0))   # a hoisted one is held
  return {'logits': logits, 'head': head, 'held': held, 'reduction': reduction, 'weight': weight}


def pipeline_slices(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """GPipe's backward takes each iteration's slice of the saved stacks, all the stage's layers at
  once, as copies: without remat of the MLP rows (tiny pipeline, fp32, 4 stages x 2 layers,
  bench/buffers.py: six [2 layers, 64 positions, 192] fp32 copies at the peak, one per saved MLP
  row), under remat of what it keeps (7b remat full, 4 stages x 2-way ZeRO-3, 4 microbatches,
  bench/buffers.py: the layer inputs, f32[8 layers, 1, 8 rows, 4096, 4096], 4 GiB). Circular
  recomputes its chunk in the backward pass and slices nothing (100m, 4 stages x 3 repeats,
  bench/buffers.py: no slice of a saved stack at the peak). XLA:GPU under remat: not read, not
  counted (the sweep's 7b GPipe point on 8 H100s is within 1.7 % without it)."""
  if shape.stages == 1 or shape.repeats > 1 or (cfg.remat != 'none' and on_gpu(shape)):
    return 0
  saved = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, cfg.remat,
                                    shape.backend)
  per_token = saved['mlp'] if cfg.remat == 'none' else sum(saved.values())
  layers = shape.layer_split(cfg).depth
  return shape.tokens / shape.pipeline_microbatches * layers * per_token


def one_f_one_b_loop(cfg: ModelConfig, policy: Policy, shape: StepShape,
                     frozen: 'Frozen | None') -> dict[str, float]:
  """The 1f1b loop's peak (parallel/pipeline_1f1b.py), which replaces the backward phases: a
  stage keeps `in_flight` chunk inputs of one microbatch each and the activations moving between
  stages, and at its peak recomputes one chunk on one microbatch (its saved activations under the
  model's remat and one layer's backward working set) or runs the head and loss on one
  microbatch, whichever is larger. Beside them: the embedding's and head's gradient sums on every
  stage (the layers' are `pipeline_grads`, as in GPipe), under ZeRO-3 (gathered once a step) the
  stage's weights whole over `fsdp`, and under remat the chunk loop's copies."""
  P, M, R = shape.stages, shape.pipeline_microbatches, shape.repeats
  micro = dataclasses.replace(shape, rows_per_device=shape.rows_per_device // M, stages=1,
                              pipeline_microbatches=1, repeats=1)
  c = policy.compute_bytes
  in_flight = min(2 * R * P - 1, M * R)
  row = micro.tokens * cfg.d_model * c
  saved = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, cfg.remat,
                                    shape.backend)
  chunk_layers = shape.layer_split(cfg).depth
  layer = layer_phase_bytes(cfg, policy, micro, trains_weights=weight_shaped(frozen, shape))
  # Without remat the chunk's backward is straight-line code and frees each layer's saved
  # activations as it passes it: at the last layer's backward, the others' are held (100m,
  # 3-layer chunks: within 4 % of the compile from 4 to 16 microbatches; all of them counted,
  # +15 % at 4). Under remat (a loop) the same count is kept (7b: a layer's input, 1 to 3 % of
  # the total).
  chunk = micro.tokens * (chunk_layers - 1) * sum(saved.values()) + layer['activations']
  # The head runs outside the stages' vmap, its logits split over `stage` as well; beside them the
  # head's copies of its table (1b, 4 stages x 2-way ZeRO-3, bench/buffers.py: the loop's peak is
  # the head's backward, with its fp32 table, the cast and the gradient's sum, each [V / 4, d]).
  head = vocab_bytes(cfg, policy, dataclasses.replace(micro, stages=P),
                     embedding_grads=frozen is None)
  tail = head['logits'] + head['head']
  # On XLA:CPU the layer's gathered weights belong to the chunk's backward, not to the head's
  # (1b, 4 stages x 2-way ZeRO-3, 512 tokens a microbatch, bench/buffers.py: the peak is the
  # head's backward, no layer's weights beside it). XLA:GPU: not read, counted beside either.
  if on_gpu(shape):
    peak, layer_weights = max(chunk, tail), layer['weights']
  elif chunk + layer['weights'] >= tail:
    peak, layer_weights = chunk, layer['weights']
  else:
    peak, layer_weights = tail, 0
  stage_weights, trained, vocab_sums, whole = loop_weights(cfg, policy, shape, frozen)
  if R > 1 and cfg.remat != 'none' and not on_gpu(shape):
    return interleaved_cpu_phases(cfg, policy, shape, in_flight, row, chunk, layer['weights'],
                                  tail, stage_weights, vocab_sums, whole)
  activations = (in_flight + 4) * row + peak
  return {'activations': activations,
          'temporaries': vocab_sums + whole + layer_weights
          + chunk_loop_copies(cfg, policy, shape, frozen, stage_weights, trained, whole)}


def interleaved_cpu_phases(cfg: ModelConfig, policy: Policy, shape: StepShape, in_flight: int,
                           row: float, chunk: float, layer_weights: float, tail: float,
                           stage_weights: float, vocab_sums: float,
                           whole: float) -> dict[str, float]:
  """Interleaved 1f1b under remat on XLA:CPU, whose peak is one of two phases (7b on 4 stages x
  2-way ZeRO-3 and on 8 stages, bench/buffers.py, each top-level loop's peak read apart). Every
  phase holds the stage's weights laid out in chunk order, whole over `fsdp` (the once-a-step
  gather, or without it a collective-permute of the stage's weights), and the picked chunk's copy.
  The ticks with forward slots hold the kept chunk inputs in the compute dtype and the chunk's
  weights once more, one matrix per layer. The backward-only ticks (the last `scan` of
  parallel/pipeline_1f1b.py:_run) carry the kept inputs converted to fp32 where XLA:CPU upcasts
  (f32[1, 31, 4, 4096, 4096], 7.75 GiB on 8 stages at 16 microbatches, bf16 before
  optimisation), beside the chunk's backward and a layer's weights, or the head's backward where
  that is larger (not read: counted as under 1f1b)."""
  read = _chunk_read(cfg, policy, shape, stage_weights, whole)
  picked, laid_out = read / shape.repeats, whole or read
  widened = FP32 / policy.compute_bytes if upcasts(policy, shape.backend) else 1
  forward_ticks = (in_flight + 4) * row + picked
  at_head = tail > chunk + layer_weights
  backward_ticks = in_flight * row * widened + (tail if at_head else chunk + layer_weights)
  if forward_ticks > backward_ticks:
    return {'activations': (in_flight + 4) * row,
            'temporaries': vocab_sums + laid_out + 2 * picked}
  return {'activations': in_flight * row * widened + (tail if at_head else chunk),
          'temporaries': vocab_sums + laid_out + picked + (0 if at_head else layer_weights)}


def _chunk_read(cfg: ModelConfig, policy: Policy, shape: StepShape, stage_weights: float,
                whole: float) -> float:
  """The stage's layer weights as a chunk loop reads them: whole over `fsdp` where they are
  gathered once a step, else the stored shards."""
  divisor = shape.tensor if whole else shards(cfg, shape, 'params')
  return stage_weights * policy.param_bytes / divisor


def chunk_loop_copies(cfg: ModelConfig, policy: Policy, shape: StepShape,
                      frozen: 'Frozen | None', stage_weights: float, trained: float,
                      whole: float) -> float:
  """Under remat the 1f1b loop (one chunk a stage) runs a chunk's layers in a loop of its own, and
  XLA:CPU holds the weights it reads twice beside the stage's: the loop's own copy and the chunk's
  weights taken apart layer by layer (7b remat full, 4 stages x 2-way ZeRO-3 and 8 stages,
  bench/buffers.py: the loop's [layers, ...] fp32 copy and one fp32 matrix per layer and weight,
  6.03 and 3.0 GiB each; the gradient sums are the step's and the loop's, `pipeline_grads`, no
  third set). Interleaved: `interleaved_cpu_phases`. XLA:GPU reads the stage's own (1b, 4 stages
  x 2-way ZeRO-3, 8 H100s, bench.buffers --target: one set of the stage's weights, no loop
  copies). A frozen base (LoRA): not read; counted as before, the loop's copy and a set of the
  trained weights' gradient sums."""
  if cfg.remat == 'none' or on_gpu(shape):
    return 0
  read = _chunk_read(cfg, policy, shape, stage_weights, whole)
  if frozen is not None:
    return read + stage_weights * trained * policy.param_bytes / shards(cfg, shape, 'grads')
  return 2 * read


def zero_bubble_loop(cfg: ModelConfig, policy: Policy, shape: StepShape,
                     frozen: 'Frozen | None') -> dict[str, float]:
  """The zb_h1 loop's peak (parallel/pipeline_zb.py), which replaces the backward phases: a stage
  keeps, per microbatch from its F to its W, its chunk's residuals (what the model's remat keeps
  of each layer), in P + 1 slots, beside two slot buffers of stage inputs
  and gradients and the four activations moving between stages; at its peak one layer's backward
  working set, or the head and loss on one microbatch. Beside them, as under 1f1b: the
  embedding's and head's gradient sums, and under ZeRO-3 the stage's weights and the vocabulary
  tables whole over `fsdp` (gathered once a step)."""
  P, M = shape.stages, shape.pipeline_microbatches
  micro = dataclasses.replace(shape, rows_per_device=shape.rows_per_device // M, stages=1,
                              pipeline_microbatches=1, repeats=1)
  slots = P + 1
  row = micro.tokens * cfg.d_model * policy.compute_bytes
  saved = saved_per_token_per_layer(cfg, policy, shape.seq_len, shape.tensor, cfg.remat,
                                    shape.backend)
  item = micro.tokens * shape.stage_layers(cfg) * sum(saved.values())
  # Under remat the slots keep what the chunk's forward returned, in the compute dtype, where
  # XLA:CPU's own saved stacks are fp32 (`upcasts`), and the slot whose B or W runs is converted
  # to fp32 beside them for the rolled backward (7b remat full, 8 stages, 8 microbatches,
  # bench/buffers.py: nine bf16 slots of 1.0 GiB and one fp32 slot of 2.0 GiB). Without remat,
  # bf16 on XLA:CPU was not measured: counted as its saved stacks.
  converted = 0
  if cfg.remat != 'none' and upcasts(policy, shape.backend):
    converted = item
    item = item * policy.compute_bytes / FP32
  layer = layer_phase_bytes(cfg, policy, micro, trains_weights=weight_shaped(frozen, shape))
  # The head runs between the stages' actions, its logits split over `stage` as well.
  tail = vocab_bytes(cfg, policy, dataclasses.replace(micro, stages=P),
                     embedding_grads=frozen is None)['logits']
  activations = (slots * item + converted + (2 * slots + 4) * row
                 + max(layer['activations'], tail))
  stage_weights, trained, vocab_sums, whole = loop_weights(cfg, policy, shape, frozen)
  # Without remat, W takes the chunk's vjp as straight-line code: every layer's weight gradient
  # is formed, whole over `fsdp`, before it is reduced (XLA:CPU; XLA:GPU reduce-scatters them
  # layer by layer). Under remat the chunk's layers run in a loop that sums them one by one, and
  # unlike 1f1b's it reads the stage's weights as they are (7b and 1b on 4 stages x 2-way ZeRO-3,
  # XLA:CPU: within 4 % of the compile with no loop copies, +19 to +35 % with 1f1b's).
  chunk = shape.layer_split(cfg).depth
  chunk_grads = (0 if cfg.remat != 'none' or on_gpu(shape) else stage_weights * (chunk - 1)
                 / max(1, shape.stage_layers(cfg)) * trained * policy.param_bytes / shape.tensor)
  return {'activations': activations,
          'temporaries': vocab_sums + whole + layer['weights'] + chunk_grads}


def loop_weights(cfg: ModelConfig, policy: Policy, shape: StepShape,
                 frozen: 'Frozen | None') -> tuple[float, float, float, float]:
  """What a pipeline whose backward runs in its loop (1f1b, zb_h1) holds of the weights: (the
  parameters of a stage's layers, the trained fraction, the embedding's and head's gradient sums,
  under ZeRO-3 the stage's weights and vocabulary tables whole over `fsdp`); the vocabulary's
  stay split over `stage`."""
  p = policy.param_bytes
  stage_weights = (shape.stage_layers(cfg)
                   * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer))
  trained = 1.0 if frozen is None else frozen.trainable / cfg.num_params
  vocab_tables = cfg.embedding_params * _vocab_matrices(cfg)
  vocab_sums = vocab_tables * trained * p / shards(cfg, shape, 'grads') / shape.stages
  whole = 0
  if shape.gathers_params:
    whole = ((stage_weights * p + vocab_tables * FP32 / shape.stages) / shape.tensor
             * gathered(cfg, shape))
  return stage_weights, trained, vocab_sums, whole


def circular_chunk_weights(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Circular under ZeRO-3: the chunk whose forward is recomputed has its weights gathered for
  that forward and holds them through its backward (unless the stage's are whole already), beside
  the weights of the layer whose backward runs (`layer_phase_bytes`), which are a cast of them
  (7b bf16_mixed, 4 stages x 2 repeats: the chunk's four layers counted, within 5 %). Where the
  layers compute in the weights' own dtype, no cast copies them: the layer's weights are one of
  the chunk's (100m fp32, 12 layers on 4 stages x 3 repeats, bench/buffers.py: one layer's
  gathered weights at the peak, at 4 and 8 microbatches; counted twice, +6.2 % at 8)."""
  if shape.repeats == 1 or not shape.gathers_params or shape.stage_whole:
    return 0
  uncast = (jnp.dtype(policy.param_dtype) == jnp.dtype(policy.compute_dtype)
            and not on_gpu(shape))   # XLA:GPU: not read
  others = shape.layer_split(cfg).depth - (1 if uncast else 0)
  return others * (cfg.attention_params_per_layer + cfg.mlp_params_per_layer) / shape.tensor * (
      FP32 if upcasts(policy, shape.backend) else policy.param_bytes) * gathered(cfg, shape)


def update_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> dict[str, float]:
  """The optimizer update's buffers besides the state and the gradients (`chain`: only while the
  update runs; `gathered`: ZeRO-1/2's new weights on XLA:GPU, once the gradients are spent)."""
  ways = shards(cfg, shape, 'optimizer')
  if on_gpu(shape):
    # XLA:GPU fuses the whole update into one elementwise pass per weight inside the switch that
    # skips a non-finite step (train/step.py), in place, 8-bit moments' codes too: no buffer of
    # its own (100m DDP on 8 H100s with 32- and 8-bit Adam, bench.buffers --target: the peak is
    # the backward's, the update's within it).
    return {'chain': 0, 'gathered': gathered_new_weights(cfg, policy, shape),
            'roomy': roomy_update_sets(cfg, policy, shape)}
  if shape.adam_bits == 32:
    # The update in fp32; weights and moments stored in 16 bits are also copied as they are
    # rewritten (XLA:CPU computes in fp32 and converts back).
    p = policy.param_bytes
    return {'chain': shape.stage_params(cfg) * (FP32 + (p if p < FP32 else 0)) / ways}
  # One slice of the largest tensor at a time: its gradient, moments and update in fp32.
  largest = max(n * FP32 / _moment_ways(n, ways, shape)
                for n, ways in param_leaves(cfg, shape) if n >= QUANTIZED_MIN_SIZE)
  return {'chain': 4 * largest / UPDATE_SLICES}


def roomy_update_sets(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """ZeRO-2 on XLA:GPU where the device has room: every stack's Adam step (one fused kernel of four
  outputs each) runs before the layer loops that write the new weights, so two fp32 sets of the
  optimizer's shards wait beside the gradients' (7b on 8 H100s or 8 A100-80GB, bench.buffers
  --target: three such sets of every stack in a 9.23 GiB temp, 47 buffers). Where that order would
  not fit, XLA:GPU's scheduler runs one stack at a time and the sets do not add up (7b on 8
  A100-40GB: 6.40 GiB of temp; 70b on 8 H100s, where the new weights' gather is the peak; the same
  70b program compiled for 1,000 GB devices holds all three sets, 95.99 GiB). `estimate` drops the
  term where the total with it exceeds `shape.device_memory`. Read with fp32 weights updated in
  place (bf16_mixed) and one stage; a master copy in the optimizer (bf16_master) or a pipeline's
  stages were not read and are not counted."""
  if (shape.zero_stage != 2 or shape.fsdp == 1 or shape.adam_bits != 32 or shape.stages > 1
      or policy.master_bytes or policy.param_bytes != FP32):
    return 0
  return 2 * shape.stage_params(cfg) * FP32 / shards(cfg, shape, 'optimizer')


def gathered_new_weights(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """ZeRO-1/2 on XLA:GPU, inside or after the update's switch (train/step.py), the gradients spent:
  - ZeRO-2: the update hands back the new weights' shards, and each stacked weight is then
    all-gathered whole into a buffer of its own, one at a time, before it is laid into the step's
    output. The largest (an MLP matrix's stack) goes after the other MLP stacks, beside the new
    shards still waiting, at most the attention's and the table's (1b and 70b on 8 H100s,
    bench.buffers --target: a 1.0 GiB fp32 gather beside 0.13 GiB of shards, and a 70.0 GiB one
    beside 5.87 GiB).
  - ZeRO-1: the update writes the new weights a layer at a time into whole stacks of their own,
    beside the largest stack's new moments, update and weights in optimizer shards, four of them
    (7b on 8 and 64, 70b on 8 H100s: 25.1 GiB of new stacks, and four [32, 11008, 512] fp32
    shards at 7b on 8)."""
  if not layout_rules(shape.zero_stage).gathers_new_weights or shape.fsdp == 1:
    return 0
  layers = shape.stage_layers(cfg)
  ways = shards(cfg, shape, 'optimizer')   # the tensor split included
  if not shape.sharded('grads'):
    shard = layers * cfg.d_model * cfg.mlp_dim * FP32 / ways
    return (shape.stage_params(cfg) * policy.param_bytes / shape.tensor + 4 * shard
            + padded_zero1_copies(cfg, policy, shape))
  if uneven(cfg, shape.fsdp):
    return padded_new_weights(cfg, policy, shape)
  largest = layers * cfg.d_model * cfg.mlp_dim * policy.param_bytes / shape.tensor
  waiting = (shape.stage_params(cfg) - layers * cfg.mlp_params_per_layer) * policy.param_bytes
  return largest + waiting / ways


def padded_zero1_copies(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """ZeRO-1 on XLA:GPU where `fsdp` does not divide d_model: besides the whole new stacks, the
  update's layer loop holds a second, d_model-first copy of each layer matrix whose d_model is its
  last dimension (the MLP's down projection, the attention's output), and in its loop the largest
  of them (the down projection) gathered from padded shards for one layer, twice (in flight and
  landed), beside one layer's MLP matrix at its true size (100m on 512 and 1,024 H100s, 1b on 384,
  bench.buffers --target: f32[12, 3072, 768]{1,0,2} and f32[2048, 16, 32, 64] copies, two
  f32[3072, 1024] gathers and a f32[768, 3072] at the update's peak; 168 MiB over the new stacks
  at 100m, 1,488 at 1b: 100m on 512 -6.4 -> -0.1 %, on 40 -17.5 -> -1.2 %). Read with SwiGLU,
  fp32 weights (bf16_mixed) and 32-bit Adam on one stage without a context split: counted there
  only; other weights scale by their bytes, and a tensor split is taken as dividing every leaf
  evenly (not read)."""
  if (shape.zero_stage != 1 or not on_gpu(shape) or not uneven(cfg, shape.fsdp)
      or shape.adam_bits != 32 or shape.stages > 1 or shape.context > 1):
    return 0
  copies, largest_padded = 0, 0
  for dims, axes in _param_tensors(cfg):
    if _d_model_last_stack(axes) and len(dims) > 2:   # matrices, not the norms' scales
      copies += math.prod(dims)
      largest_padded = max(largest_padded, math.prod(_padded(dims, axes, shape.fsdp)[1:]))
  layer_values = 2 * largest_padded + cfg.d_model * cfg.mlp_dim
  return ((copies * shape.stage_layers(cfg) / cfg.num_layers + layer_values) * policy.param_bytes
          / shape.tensor)


def _d_model_last_stack(axes: tuple) -> bool:
  """A layer-stacked parameter whose d_model is its last dimension (the MLP's down projection, the
  attention's output projection, the norms' scales): XLA:GPU lays such stacks out anew when their
  d_model shards are padded."""
  return axes[:1] == ('layers',) and axes[-1] == 'embed'


def padded_new_weights(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """ZeRO-2 on XLA:GPU where `fsdp` does not divide d_model: a new weight gathered from padded
  shards is larger than its old weight's buffer, so none lands there. The stacks whose d_model is
  their last dimension (the MLP's down projection, the attention's output) leave the update's
  switch whole, at their true size; the others are gathered at the padded size into the temp,
  the three largest at once (100m on 512 and 1,024 H100s, 1b and 7b on 384, bench.buffers
  --target: the two MLP input stacks and the tied table at 1b, an attention stack at 7b, beside
  the down and output stacks: 4.60 of 4.61 GiB of temp at 1b, 20.52 of 20.58 at 7b; at 100m the
  third, a 36 MiB attention stack, is not at the peak, nor at 1b on 24: +8.6 % there). "Whole"
  takes the norm scales too (d_model is their only dimension). Measured at tensor 1, one stage,
  with SwiGLU; a tensor or stage split is taken as dividing every leaf evenly (not read)."""
  whole, gathered_padded = 0, []
  for dims, axes in _param_tensors(cfg):
    if _d_model_last_stack(axes):
      whole += math.prod(dims)
    else:
      gathered_padded.append(math.prod(_padded(dims, axes, shape.fsdp)))
  values = whole + sum(sorted(gathered_padded)[-3:])
  return values * policy.param_bytes / shape.tensor * shape.stage_layers(cfg) / cfg.num_layers


def transposed_stacks(cfg: ModelConfig, policy: Policy, shape: StepShape,
                      frozen: 'Frozen | None' = None) -> float:
  """ZeRO-3 on XLA:GPU: the gradient stacks whose sharded d_model is their last dimension (the MLP's
  down projection, the attention's output projection) are also held transposed, d_model first,
  through the layers' backward (70b ZeRO-3 x tensor 4 on 8 H100s, bench.buffers --target: fp32
  [4096, 80, 7168] and [4096, 80, 16, 128] copies beside the stacks, 11.25 GiB; the same pair at
  1b and 7b)."""
  if not on_gpu(shape) or not shape.sharded('params') or shape.fsdp == 1 or frozen is not None:
    return 0
  if relaid_stage_weights(cfg, policy, shape):
    # Circular's loop sums into a carry laid out d_model first itself; the transposed copies at
    # the peak are of the re-laid weights, which `relaid_stage_weights` counts.
    return 0
  q = cfg.num_heads * cfg.head_dim
  return (shape.stage_layers(cfg) * (cfg.mlp_dim + q) * cfg.d_model * policy.param_bytes
          / (shape.fsdp * shape.tensor))


def relaid_stage_weights(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """Circular on XLA:GPU: the stage's weights re-laid from their contiguous stored order into the
  schedule's chunks (`parallel/pipeline.py:on_stages`, an all-to-all and a collective-permute in
  the entry computation), a second copy of the stage's layer weight shards held through the step
  beside the stored one; the layers whose sharded d_model is last are held transposed (7b, 4
  stages x 2 repeats x 2-way ZeRO-3, 4 microbatches on 8 H100s, bench.buffers --target: five
  f32[2, 1, 1, 4, 2048, ...] collective-permute results and two `input_transpose_fusion`s, 3.02
  GiB, at the backward loop's peak; the loop's gradient carry is a set of its own). XLA:CPU: not
  apart from the terms it is calibrated on; gathered whole once (`stage_whole`): not read."""
  if shape.repeats == 1 or not on_gpu(shape) or shape.backward_in_loop or shape.stage_whole:
    return 0
  return shape.stage_layers(cfg) * cfg.params_per_layer * policy.param_bytes / shards(
      cfg, shape, 'params')


def fp32_moment_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """With 16-bit weights and 32-bit Adam, optax forms the new first moment in fp32 (from the
  fp32 hyper-parameters) and train/step.py's state keeps it 16-bit only by a cast at the end (with
  an fp32 master the moments are fp32 already, and the same buffer is seen: 0.048 GiB at 100m
  ZeRO-3 on 8 devices, bench/layouts.py).
  Under ZeRO, XLA computes the part that needs no gradient (b1 * m) early and keeps that fp32
  moment shard live through the backward pass (measured: 3.14 GiB at 7B ZeRO-3, with 1 and with 4
  microbatches); under DDP (the small preset, measured) it schedules it after, and it adds nothing.
  XLA:CPU of jax 0.11/0.12 (bf16 matmuls in bf16) schedules it after the backward pass under
  ZeRO-3 too (1b pure bf16 ZeRO-3 on 8 devices, jax 0.12.0.1, bench/buffers.py: the peak is the
  embedding gradients' reduction, four fp32 vocabulary buffers and nothing of the moments; under
  ZeRO-2 it is still there: tests/test_estimate.py's tiny bf16_master case, -10 % without it)."""
  if shape.adam_bits != 32 or policy.param_bytes >= FP32 or not shape.sharded('optimizer'):
    return 0
  if shape.backend == 'cpu' and not cpu_upcasts_bf16() and shape.sharded('params'):
    return 0
  if on_gpu(shape):   # XLA:GPU forms it inside the fused update (1b pure bf16 ZeRO-3 on 8 H100s)
    return 0
  return shape.stage_params(cfg) * FP32 / shards(cfg, shape, 'optimizer')


@dataclasses.dataclass(frozen=True)
class Frozen:
  """LoRA: only `trainable` values (the adapters) get gradients and optimizer state; the frozen
  base is stored in `base_bytes` (compute-dtype matrices, or quantized kernels under QLoRA)."""
  trainable: int
  base_bytes: int
  quantized: bool = False   # QLoRA: kernels dequantized one layer at a time inside the scan


def weight_shaped(frozen: Frozen | None, shape: StepShape) -> bool:
  """Whether a layer's backward holds a weight gradient's worth of weight-shaped buffers: where
  the weights train, and under ZeRO-3 for a frozen base in the compute dtype (LoRA), whose
  transposed shards and gathered next layers XLA:GPU holds in their place (20b LoRA on 8 H100s,
  bench.buffers --target: 1.7 GiB at the head's backward). A quantized base (QLoRA) is gathered
  and dequantized a layer at a time with nothing beside it (20b QLoRA on 8 H100s: +27 % counted
  so, +0.3 % without)."""
  return frozen is None or (shape.gathers_params and not frozen.quantized)


# The remat policies that keep in host memory what another keeps on the device: the same program
# otherwise (models/llama.py).
OFFLOADED_REMAT = {'offload': 'full', 'dots_offload': 'dots'}


def offloaded(cfg: ModelConfig, policy: Policy, shape: StepShape,
              frozen: Frozen | None = None) -> dict[str, float]:
  """Bytes per device in host memory, by part (`total` their sum): the optimizer's state
  (`parallel.offload_optimizer`), the saved activations (`model.remat=offload|dots_offload`) and
  the frozen base (`parallel.offload_frozen`). Where the step writes host memory inside the
  program (the new optimizer state, the activations) XLA:CPU keeps it in the device's temp: the
  CPU estimate counts it there as well (`estimate`), and here too, as the host memory a GPU would
  use."""
  parts = {'optimizer': 0, 'optimizer_update': 0, 'activations': 0, 'frozen': 0}
  if shape.offload_optimizer:
    parts['optimizer'] = _state_bytes(cfg, policy, shape, frozen)
    # The update writes the layers' new state beside the old (a scan's output, train/offload.py):
    # on a GPU in host memory, on XLA:CPU in the device's temp (`estimate`'s host_writes). The
    # other weights' new state takes its old one's place (1b bf16_master on one H200, compiled:
    # 24.69 GiB of host memory, the state's 13.81 and the layers' new 10.88).
    layers = cfg.num_layers * cfg.params_per_layer / cfg.num_params if frozen is None else 1
    parts['optimizer_update'] = parts['optimizer'] * layers if shape.backend != 'cpu' else 0
    if shape.update_on_host and shape.backend != 'cpu':
      # Computed on the host, the update writes the whole new state beside the old, and takes the
      # gradients and the weights there in their stored dtype, cut to the optimizer's shards
      # (1b bf16_master on one H200, compiled: 32.23 GiB of host memory, the state's 13.81, the
      # new 13.81 and 2 x 2.30).
      n = shape.stage_params(cfg) if frozen is None else (
          frozen.trainable * shape.stage_params(cfg) / cfg.num_params)
      parts['optimizer_update'] = (parts['optimizer']
                                   + 2 * n * policy.param_bytes / shards(cfg, shape, 'optimizer'))
  if cfg.remat in OFFLOADED_REMAT:
    parts['activations'] = activation_bytes(
        dataclasses.replace(cfg, remat=OFFLOADED_REMAT[cfg.remat]), policy, shape)
  if shape.offload_frozen and frozen is not None:
    parts['frozen'] = frozen.base_bytes * shape.stage_params(cfg) / cfg.num_params / shards(
        cfg, shape, 'params')
  parts = {k: int(v) for k, v in parts.items()}
  parts['total'] = sum(parts.values())
  return parts


def _state_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape,
                 frozen: Frozen | None) -> float:
  """The optimizer's state on one device: the model's, or with LoRA the adapters' (fp32 Adam)."""
  if frozen is None:
    return optimizer_bytes(cfg, policy, shape)
  n = frozen.trainable * shape.stage_params(cfg) / cfg.num_params
  return n * (2 * policy.moment_bytes + policy.master_bytes) / shards(cfg, shape, 'optimizer')


def streamed_state_bytes(cfg: ModelConfig, policy: Policy, shape: StepShape) -> float:
  """An offloaded optimizer state's bytes on the device during the update (train/offload.py): one
  layer's state, or the other weights' (embeddings, head, final norm) in one piece, whichever is
  larger, brought over and sent back (twice)."""
  per_value = (2 * policy.moment_bytes + policy.master_bytes) / shards(cfg, shape, 'optimizer')
  rest = cfg.num_params - cfg.num_layers * cfg.params_per_layer
  return 2 * max(cfg.params_per_layer, rest) * per_value


def format_parts(parts: dict) -> str:
  """`params 1.2 GiB + grads ... - unformed_grads ...`: the estimate's nonzero parts, in order."""
  text = ''
  for part, value in parts.items():
    if part == 'total' or not value:
      continue
    term = f'{part} {format_bytes(abs(value))}'
    text += (f' {"-" if value < 0 else "+"} ' if text else ('-' if value < 0 else '')) + term
  return text


def estimate(cfg: ModelConfig, policy: Policy, shape: StepShape,
             frozen: Frozen | None = None) -> dict[str, float]:
  """Bytes per device by part (see the module docstring); `total` is their sum.

  With `frozen` (LoRA) the parameters are the frozen base and the adapters, and the gradients,
  the moments and the update are the adapters' alone (as fp32 Adam, whatever `adam_bits`: the
  adapters are small); the activation terms are the full model's, since the backward pass still
  runs through every layer. The base is sharded like parameters.

  What lives in host memory (`offloaded`) is not counted on the device, except what the step writes
  there on XLA:CPU (see `offloaded`); on a GPU the device holds instead what streams through it:
  one layer's optimizer state during the update, one layer's frozen base, one layer's block input
  on its way to host memory."""
  if shape.context > 1:   # the context-parallel attention is the blockwise kernel (models/context.py)
    cfg = dataclasses.replace(cfg, attention='flash')
  offloads_activations = cfg.remat in OFFLOADED_REMAT
  if offloads_activations:
    cfg = dataclasses.replace(cfg, remat=OFFLOADED_REMAT[cfg.remat])
  n = shape.stage_params(cfg)
  p = policy.param_bytes
  params = n * p / shards(cfg, shape, 'params')
  grads = n * p / shards(cfg, shape, 'grads')
  optimizer = optimizer_bytes(cfg, policy, shape)
  if frozen is not None:
    on_stage = n / cfg.num_params   # the base's share on one stage
    n = frozen.trainable * on_stage
    params = (frozen.base_bytes * on_stage + n * p) / shards(cfg, shape, 'params')
    grads = n * p / shards(cfg, shape, 'grads')
    optimizer = n * (2 * policy.moment_bytes + policy.master_bytes) / shards(cfg, shape, 'optimizer')
  saved = (activation_bytes(cfg, policy, shape)
           + gpu_saved_weight_casts(cfg, policy, shape, frozen))
  quantized = frozen is not None and frozen.quantized
  if (on_gpu(shape) and shape.microbatches > 1 and shape.gathers_params and shape.stages == 1
      and not (quantized and cfg.remat == 'full')):
    # In the microbatch loop XLA:GPU initialises the next microbatch's saved stacks while the
    # last one's are live: two sets (7b ZeRO-3 x tensor 2 without remat, 8 microbatches on 8
    # H100s, bench.buffers --target: each saved [layers, rows, length, width] stack twice, as a
    # zero-filled buffer and the filled one; compiled 58.73 GiB, 38.14 by one set). The zero fill
    # is hoisted out of the loop and scheduled at the step's start (7b LoRA and full, ZeRO-3 in 4
    # microbatches: both sets at the peak); over a quantized base under full remat the scheduler
    # puts it after the loop, and one set is live at the peak, after the forward loop (7b QLoRA in
    # 4 microbatches on 8 H100s: the fill at 1383 of 2505 in XLA's live ranges, against 71 of 2203
    # for LoRA; compiled 3.00 GiB, +49 % with two sets; 20b on 8 and 7b on one H100 +53 and +46 %).
    # Without remat the peak is inside the forward loop, beside the fill (100m QLoRA, remat none:
    # both sets at the peak; counting one made that estimate 17 % under the compiled 2.14 GiB).
    # Where the weights are not gathered (DDP, tensor parallel, ZeRO-1/2, their LoRA) and in the
    # pipelines, one set: the shipped 1b configs in 8 microbatches on 8 H100s, bench.buffers
    # --target (tp, zero2, lora, ddp: one [16, rows, 2048, 2048] stack at the peak; pipeline: one
    # [7, 4, 1, 1, 2048, 2048]; fsdp, ZeRO-3: the zero fill beside the filled stack).
    saved *= 2
  # The ring lives through the loop (forward, then its gradient backward), not the head's backward.
  ring = pipeline_ring_bytes(cfg, policy, shape)
  # A microbatch's own gradients beside the step's sum; on XLA:GPU, where they are sharded, also
  # the zero-filled set the next microbatch starts from, as for the saved stacks (70b ZeRO-3 in 2
  # microbatches on 64 H100s, bench.buffers --target: three sets of the layers' gradient stacks at
  # the layers' backward). Replicated (DDP, ZeRO-1), two sets in all: the sum and the microbatch's,
  # zero-filled from the head's backward on (1b DDP in 8 microbatches on 8 H100s, bench.buffers
  # --target: 24.89 GiB compiled, +16.7 % with a third set counted). Read where each microbatch's
  # gradients are all-reduced (packed rows with cuDNN's attention, train/run.py); the per-device
  # accumulation's sums (unpacked rows) were not read on XLA:GPU.
  # In a pipeline the stage's loop carry (`pipeline_grads`) is the second set (1b GPipe, 4 stages
  # x 2-way ZeRO-3 in 8 microbatches on 8 H100s, bench.buffers --target --phases: the sum and two
  # more sets of the stage's gradient shards at the layers' backward, 0.5 GiB each; compiled 4.80
  # GiB, +14.9 % with a third counted and the sets at the loss, below).
  # Under ZeRO-2, one (7b in 4 microbatches on 8 A100s and the shipped zero2:1b on 8 H100s,
  # bench.buffers --target --phases: the sum and one zero-filled set at the layers' backward).
  sets = 2 if on_gpu(shape) and shape.gathers_params and shape.stages == 1 else 1
  microbatch_grads = grads * sets if shape.microbatches > 1 else 0
  # The pipeline loop accumulates its stage's layer gradients in a carry of its own, added to the
  # step's gradients when it ends (7b GPipe and circular, 4 stages x 2-way ZeRO-3, bench/buffers.py:
  # a second set of the stage's gradient shards, 3.0 GiB, beside them at the peak).
  stage_layers = shape.stage_layers(cfg) * cfg.params_per_layer
  pipeline_grads = (stage_layers * p / shards(cfg, shape, 'grads')
                    if shape.stages > 1 and frozen is None else 0)
  if shape.schedule == 'interleaved_1f1b' and shape.repeats > 1 and not on_gpu(shape):
    # Interleaved sums into one carry slice by slice: beside it the picked chunk's slice and,
    # under remat (the chunk's layers in a loop), the chunk's new gradient, a chunk's share each
    # (7b remat full, R 2, bench/buffers.py: [4, 1, ...] and [1, 1, 4, ...] beside the
    # [1, 2, 4, ...] carry, 1.5 GiB each; 100m remat none, R 3: the slice alone, 13 MiB).
    pipeline_grads *= (2 if cfg.remat != 'none' else 1) / shape.repeats
  # parallel.pipeline_gather_once: the stage's weights gathered whole before the loop and held
  # through the step (gpipe and circular, 4 stages x 2-way ZeRO-3, bench.studies.pipeline
  # --gather_once, XLA:CPU: 7b +6.03 GiB compiled at every M from 4 to 32, the stage's fp32 layer
  # weights; 100m +139 to +152 MiB, half as much again, which this leaves out: -3.7 to -4.0 %).
  # A frozen base (LoRA, QLoRA) is gathered in its stored bytes (not measured).
  stored_per_param = p if frozen is None else frozen.base_bytes / cfg.num_params
  whole_stage = (stage_layers * stored_per_param * gathered(cfg, shape) / shape.tensor
                 if shape.stage_whole else 0)
  # parallel.pipeline_stage_layers other than the storage's blocks: the chunks' layers are moved
  # stage to stage out of the stored stack (parallel/stage_layers.py). GPipe and circular hold no
  # more for it (1b, 15 layers as 3,4,4,4 against 4,4,4,3 on 4 stages x 2-way fsdp, bench.buffers:
  # XLA:CPU 5.85 against 5.85 GiB under ZeRO-3, 6.36 against 6.87 under ZeRO-2; XLA:GPU ZeRO-2
  # 5.40 against 5.17, a quarter of the stage's weights, not counted). The 1F1B schedules hold
  # the taken layers through their loop: a set of the stage's layer weights as run, beside the
  # stored ones (405b, 126 layers on 64 stages x tensor 2 x context 4, ZeRO-2, zb_h1, XLA:GPU:
  # the taken f32 [1, 2, 16384, 26624] stacks, 3.25 GiB each, at the peak). Under ZeRO-3 the
  # taken shards only feed the gather before the loop, whose whole weights `loop_weights` counts.
  taken = (stage_layers * p / shards(cfg, shape, 'params') if shape.takes_layers(cfg)
           and shape.backward_in_loop and not shape.gathers_params else 0)
  # A pipeline stage runs a layer on one pipeline microbatch at a time. A frozen base has no
  # weight gradient, but may hold as much in other weight-shaped buffers (`weight_shaped`; without
  # them 7b and 20b LoRA on 8 H100s are 15 and 20 % under the compiled total).
  layer = layer_phase_bytes(cfg, policy, dataclasses.replace(
      shape, rows_per_device=shape.rows_per_device // shape.pipeline_microbatches),
                            trains_weights=weight_shaped(frozen, shape))
  # A frozen table is stored in the compute dtype (train/state.py): on XLA:GPU the head takes it
  # as it is, with no cast of its own (1b LoRA, DDP in 8 microbatches on 8 H100s, bench.buffers
  # --target: no [vocabulary, d_model] table beside the logits; +11.7 % with a cast counted).
  head_policy = (dataclasses.replace(policy, param_dtype=policy.compute_dtype)
                 if frozen is not None and on_gpu(shape) else policy)
  vocab = vocab_bytes(cfg, head_policy, shape, embedding_grads=frozen is None)
  # XLA:GPU forms the embedding's gradient after the head's backward peak (1b DDP, ZeRO-1 on 8
  # H100s, bench.buffers --target: no [vocabulary, d_model] gradient beside the logits), and whole
  # (unsharded) layer gradients only in the layers' backward (1b on one H200, remat dots and none,
  # bench.buffers --target=1xH200-141GB: no gradient at the head's peak; +9.5 and +5.2 % counted)
  # unless remat is full or the gradients are summed over devices: then the layers' zero-filled
  # gradient stacks are there before the loss (the same step, remat full: f32 [16, 2048, 8192] x 3
  # and the attention's, 3.6 GiB, at the loss's peak, -11.9 % without them; 1b at 8 rows a device
  # on 8 H100s, DDP and ZeRO-1, remat none and dots: -9.7 to -12.1 % without them). Under tensor
  # parallelism they are not, even so (1b, remat full, 8 rows a device on 8 H100s: tensor 8,
  # tensor 4 x data 2 and tensor 2 x data 4, bench.buffers --target --phases: no layer gradient
  # stack at the loss; +10.2, +9.2 and +11.0 % counted).
  unformed = 0
  if on_gpu(shape) and frozen is None:
    whole = (not shape.scatters_grads and shape.microbatches == 1
             and (shape.tensor > 1 or (cfg.remat != 'full' and shape.data_parallel == 1)))
    unformed = grads if whole else cfg.embedding_params * p / shards(cfg, shape, 'grads')
  update = (update_bytes(cfg, policy, shape) if frozen is None else   # the adapters' (fp32 Adam)
            {'chain': 0 if on_gpu(shape) else n * (FP32 + (p if p < FP32 else 0)) / shards(cfg, shape, 'optimizer')})
  if shape.offload_optimizer:   # the update runs a layer (or the other weights) at a time
    rest = cfg.num_params - cfg.num_layers * cfg.params_per_layer
    update = {'chain': update['chain'] * max(cfg.params_per_layer, rest) / n}
  # Held in both backward phases besides gradients and saved activations.
  # A frozen base is stored in the compute dtype (train/state.py), which is what decides XLA:CPU's
  # whole-stack fp32 copy.
  # A quantized base is dequantized layer by layer inside the scan: no copy of the whole stack.
  stored = policy if frozen is None else dataclasses.replace(policy, param_dtype=policy.compute_dtype)
  copies = 0 if quantized else cpu_weight_copies(cfg, stored, shape)
  shard_copies = 0 if quantized else cpu_shard_copies(cfg, stored, shape)
  common = microbatch_grads + copies + pipeline_grads + whole_stage + taken
  # Under ZeRO-3 XLA:GPU gathers the last layer's weights while the head's backward runs, twice:
  # for its recomputed forward and, pipelined into the backward loop, for its backward (1b ZeRO-3
  # on 8 and 512 H100s, bench.buffers --target: two to three layers' matrices in flight at the
  # head's peak).
  prefetched = (2 * cfg.params_per_layer / shape.tensor * policy.compute_bytes
                * gathered(cfg, shape) if on_gpu(shape) and shape.gathers_params else 0)
  # Gradients that the state's part counts but XLA:GPU has not formed yet here come off it
  # (`unformed_grads`, negative).
  # In microbatches, where the weights are not gathered, the loss's peak comes before any of the
  # microbatch's own gradients and after every gradient's sum exists (a carry of the microbatch
  # loop): the shipped 1b tp and zero2 configs in 8 microbatches on 8 H100s, bench.buffers
  # --target --phases (the forward's loss at the step's peak, beside the sum alone; compiled 6.85
  # and 8.77 GiB, the estimate +19.1 and +9.2 % with the microbatch's set and a second saved set).
  # So does a pipeline's (the same 1b GPipe: the forward's loss beside the sum alone), before its
  # stage's carry too.
  head_common, head_unformed = common, unformed
  if (on_gpu(shape) and shape.microbatches > 1
      and (not shape.gathers_params or shape.stages > 1)):
    head_common, head_unformed = common - microbatch_grads - pipeline_grads, 0
  head_phase = {'activations': saved + vocab['logits'],
                'temporaries': head_common + vocab['head'] + prefetched,
                **({'unformed_grads': -head_unformed} if head_unformed else {})}
  # GPipe's backward runs each stage's layers as a scan inside the iterations' loop, which sums
  # their gradients in a carry of its own, started from a copy: beside the loop's sum, two more
  # sets of the stage's gradient shards (7b, 4 stages x 2-way ZeRO-3, 4 microbatches,
  # bench/buffers.py: [1, 8, ...], [8, 1, ...] and a `wrapped_copy` in the loop's body, 3.0 GiB
  # each, where the estimate had two). Circular's chunks do not (100m, bench/buffers.py). XLA:GPU:
  # not read, not counted.
  gpipe_scan_grads = (pipeline_grads if shape.repeats == 1 and not on_gpu(shape)
                      and not shape.stage_whole else 0)
  # Gathered once (parallel.pipeline_gather_once), the stage's weights are whole over `fsdp`
  # through the loop, and so are the two gradient sets its backward holds, the step's and the
  # loop's (7b, 4 stages x 2-way ZeRO-3, 4 microbatches, bench/buffers.py: GPipe's [1, 8, 4096,
  # ...] and [8, 1, 4096, ...], 6.03 GiB each, and no third; circular's loop sum and its chunk's
  # [4, 1, 4096, ...] pair). Circular without remat: not read (100m, 1-layer chunks: within 5 %
  # without it), not counted. XLA:GPU: not read, not counted.
  whole_sums = (2 * (stage_layers * p * gathered(cfg, shape) / shape.tensor - pipeline_grads)
                if shape.stage_whole and not on_gpu(shape) and frozen is None
                and (shape.repeats == 1 or cfg.remat != 'none') else 0)
  layer_phase = {'activations': (saved + ring + layer['activations']
                                 + pipeline_slices(cfg, policy, shape)),
                 'temporaries': common + shard_copies + layer['weights'] + vocab['held']
                 + transposed_stacks(cfg, policy, shape, frozen)
                 + circular_chunk_weights(cfg, policy, shape) + gpipe_scan_grads + whole_sums
                 + relaid_stage_weights(cfg, policy, shape)}
  # After the microbatch loop: no microbatch's own gradients any more (1b ZeRO-3, 4 microbatches).
  reduction_phase = {'activations': 0, 'temporaries': copies + vocab['reduction']}
  # Before the layers run backward: the saved stacks converted to fp32 beside their 16-bit selves
  # (XLA:CPU only), and the gradient reaching the last layer.
  converted = stack_convert_bytes(cfg, policy, shape)
  convert_phase = {'activations': saved + converted + ring
                   + (shape.tokens * cfg.d_model * policy.compute_bytes if converted else 0),
                   'temporaries': common + shard_copies + vocab['held']}
  # On XLA:GPU, the head's weight gradient formed, before the layers' backward (the barrier in
  # quant/contraction.py): the logits' gradient beside the head's gradients held (`vocab_bytes`),
  # the gradients not formed yet off as at the head's peak.
  weight_phase = ({'activations': saved + vocab['weight'],
                   'temporaries': common + vocab['held'],
                   **({'unformed_grads': -unformed} if unformed else {})} if on_gpu(shape) else {})
  backward = max(head_phase, layer_phase, reduction_phase, convert_phase, weight_phase,
                 key=lambda phase: sum(phase.values()))
  if shape.backward_in_loop:
    loop = (zero_bubble_loop if shape.schedule == 'zb_h1' else one_f_one_b_loop)(
        cfg, policy, shape, frozen)
    backward = {'activations': loop['activations'], 'temporaries': common + loop['temporaries']}
  # The update holds the gradients and the update's buffers; the activations are gone by then.
  # Under ZeRO-1/2 XLA:GPU forms the new weights whole once the update has spent the gradients
  # (`gathered_new_weights`).
  # An offloaded state passes through a GPU only here, a layer (or the other weights) at a time:
  # none of it is on the device at the backward's peak (1b bf16_master, remat dots, on one H200,
  # jax 0.11.2: allocator peak 25.70 GiB with it offloaded, the temp the same 23.40 GiB as
  # without; bench/results/issue47-nvidia-h200-3).
  # Computed on the host (`update_on_host`), none of it reaches the device.
  streamed = (streamed_state_bytes(cfg, policy, shape)
              if shape.offload_optimizer and on_gpu(shape) and not shape.update_on_host else 0)
  update_phase = update['chain'] + streamed
  spent = update['gathered'] - grads if update.get('gathered') else 0   # the gradients are spent
  roomy = update.get('roomy', 0)
  update_phase += max(spent, roomy) if roomy else spent
  parts = {
      'params': params,
      'grads': grads,
      'optimizer': optimizer,
      **backward,
      'update': max(0, update_phase - sum(backward.values())),
      'moment_fp32': (fp32_moment_bytes(cfg, policy, shape) if frozen is None else
                      fp32_moment_bytes(cfg, policy, shape) * n / cfg.num_params),
  }
  if shape.offload_optimizer:   # the state's arguments are in host memory
    # The moments reach the device a layer at a time, inside the update: no moment is formed
    # early (70b ZeRO-3 on 8 devices: compiled 192.44 GiB, -0.4 % from the estimate without it).
    parts['moment_fp32'], parts['optimizer'] = 0, 0
    if not on_gpu(shape):   # XLA:CPU writes the new state into its temp: the size of the state
      parts['host_writes'] = optimizer
  if shape.offload_frozen and frozen is not None:
    base = offloaded(cfg, policy, shape, frozen)['frozen']
    parts['params'] -= base
    if on_gpu(shape):   # one layer's base on its way in, the next one's prefetched
      parts['params'] += 2 * base / cfg.num_layers
  if offloads_activations and on_gpu(shape):
    saved_on_host = activation_bytes(cfg, policy, shape)
    parts['activations'] = max(0, parts['activations'] - saved_on_host) + 2 * (
        saved_on_host / cfg.num_layers)
  if roomy > spent and shape.device_memory and sum(parts.values()) > shape.device_memory:
    # No room for the overlapping order: the scheduler's one stack at a time instead.
    parts['update'] = max(0, update_phase - roomy + spent - sum(backward.values()))
  parts = {k: int(v) for k, v in parts.items()}
  parts['total'] = sum(parts.values())
  return parts
