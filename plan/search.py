"""The planner: every recipe the target can run, the ones the analytic model says fit, ranked by
estimated step time, the fastest verified by compiling its train step for the target: with XLA:GPU
for the target's compile-only GPUs where the CUDA plugin is installed (parallel/target.py), else
with XLA:CPU on as many simulated devices. The estimate ranks as the verifying compiler compiles
(`backend`: its GPU or its CPU terms).

A recipe is precision x Adam bits x ZeRO stage x tensor degree x context shards (long sequences)
x remat x microbatches, and on
targets of several nodes pipeline stages x pipeline microbatches x schedule (GPipe, circular,
1F1B, interleaved 1F1B or zb_h1; the two with several chunks a stage at 2, plan/cost.py);
the model, global batch and sequence length stay the config's, and so do its LoRA adapters and
frozen-base storage (a LoRA config is sized with only the adapters training, and its compute has
no weight gradients). A recipe fits when its per-device
total stays under the device memory less MARGIN (kept for the CUDA context, NCCL buffers and
allocator fragmentation, which neither the compiler's figure nor the estimate sees).

Quality is part of the objective: a policy whose optimizer updates 16-bit weights directly (pure
bf16: a step below half a bf16 spacing of a weight is rounded away, and Adam's moments are bf16)
is chosen only when the caller allows it (`allow_pure_bf16`, `main.py --plan_allow_pure_bf16`);
otherwise the plan says what it gave up by keeping an fp32 master (`tradeoff`).
"""
import dataclasses
import itertools
import math
import time

import ml_collections

from memory.estimate import Frozen, StepShape, estimate, offloaded, streamed_state_bytes
from plan.cost import MFU_ASSUMED, Recipe, step_seconds
from plan.target import Target
from precision.policy import get_policy
from train import checks

MARGIN = 0.10
HOST_MARGIN = 0.20   # of a node's host memory, kept for the OS, the data loader and page cache
PRECISIONS = ('bf16_master', 'bf16_mixed', 'bf16')
ADAM_BITS = (32, 8)
REMATS = ('none', 'dots', 'full')
# The pipeline schedules offered across nodes, with their chunks a stage (parallel/pipeline.py).
PIPELINE_SCHEDULES = (('gpipe', 1), ('1f1b', 1), ('zb_h1', 1), ('circular', 2),
                      ('interleaved_1f1b', 2))
MAX_COMPILES = 6
CONTEXT_MIN_CHUNK = 512   # positions per zigzag chunk: one GPU flash block


class PlanError(ValueError):
  pass


@dataclasses.dataclass
class Candidate:
  recipe: Recipe
  estimate: dict          # analytic bytes per device, by component (as the verifier compiles it)
  seconds: dict           # estimated step time, by component
  compiled: int | str | None = None   # bytes per device, or why it did not compile
  host: dict = dataclasses.field(default_factory=dict)   # bytes per device in host memory, on a GPU

  @property
  def device_bytes(self) -> float:
    """What the target's device holds: the estimate, less what the step writes to host memory,
    which XLA:CPU keeps in device temp (an offloaded optimizer's new state), plus, from XLA:CPU's
    terms, what a GPU streams through the device instead (a layer's state at a time; the GPU
    estimate counts it in the update)."""
    return (self.estimate['total'] - self.estimate.get('host_writes', 0)
            + self.host.get('streamed', 0))


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def apply(config: ml_collections.ConfigDict, recipe: Recipe, devices: int):
  """The config with the recipe's settings (a copy)."""
  config = ml_collections.ConfigDict(config.to_dict())
  config.precision = recipe.precision
  config.quant.adam_bits = recipe.adam_bits
  config.parallel.zero_stage = recipe.zero_stage
  config.mesh = recipe.mesh(devices)
  config.model.remat = recipe.remat
  config.train.microbatches = recipe.microbatches
  config.parallel.pipeline_schedule = recipe.schedule
  config.parallel.pipeline_microbatches = recipe.pipeline_microbatches
  config.parallel.pipeline_repeats = recipe.repeats
  config.parallel.pipeline_stage_layers = ''   # the default split of the recipe's stages
  config.parallel.pipeline_gather_once = False  # not a recipe's choice (1f1b ones gather once)
  config.parallel.offload_optimizer = recipe.offload
  config.model.context_attention = recipe.context_attention
  return config


def recipes(config, target: Target, stages: bool = True) -> list[Recipe]:
  """Every recipe the target can run; `stages`: pipeline stages are offered where the target is
  more than one node (at most one stage per node)."""
  cfg, n, batch = checks.model_config(config), target.count, config.train.batch_size
  stage_counts = [p for p in _divisors(n) if p == 1 or (
      stages and n > target.per_node and p <= n // target.per_node and cfg.num_layers >= p)]
  seq_len = config.train.seq_len
  found = []
  for p, t, c in itertools.product(stage_counts, _divisors(n), _divisors(n)):
    if n % (p * t * c) or t * c > target.per_node or any(size % t for size in (
        cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size, cfg.mlp_dim)):
      continue
    # Context shards (models/context.py) within a node, each holding two chunks of a sequence
    # that the flash blocks divide: worth their key/value traffic only at long sequences, which
    # the step-time model weighs against the memory they save.
    if c > 1 and (seq_len % (2 * c) or seq_len // (2 * c) < CONTEXT_MIN_CHUNK):
      continue
    dp = n // (p * t * c)
    if batch % dp:
      continue
    for stage, m, precision, bits, remat in itertools.product(
        range(4), _divisors(batch // dp), PRECISIONS, ADAM_BITS, REMATS):
      if stage and dp * c == 1:                    # nothing to shard over: the same as ZeRO-0
        continue
      if bits == 8 and t > 1:   # 8-bit moments are flattened into blocks, which tensor parallelism
        continue                # would reshard every step (all-to-all); not offered until fixed
      if bits == 8 and config.lora.rank:   # the adapters' moments are too small to matter
        continue
      # A pipeline: any count of pipeline microbatches from the stage count up that divides the
      # rows, under GPipe, 1F1B (same bubble; 1F1B keeps less, recomputes more), their two-chunk
      # forms circular and interleaved 1F1B (half the bubble, the weights re-laid out once a
      # step; interleaved 1F1B takes the microbatches in groups of P) or zb_h1 (a third of the
      # bubble, no recomputation, the chunk's residuals kept for P + 1 microbatches).
      for pm in [1] if p == 1 else [d for d in _divisors(batch // (dp * m)) if d >= p]:
        schedules = [('gpipe', 1)] if p == 1 else [
            (name, repeats) for name, repeats in PIPELINE_SCHEDULES
            if cfg.num_layers >= p * repeats and not (name == 'interleaved_1f1b' and pm % p)]
        for (schedule, repeats), method in itertools.product(
            schedules, ['gather'] if c == 1 else ['gather', 'ring']):
          found.append(Recipe(precision, bits, stage, t, remat, m, p, pm, schedule=schedule,
                              repeats=repeats, context=c, context_attention=method))
          # The optimizer state in host memory: streamed a layer at a time, so 32-bit Adam and
          # no pipeline (train/checks.py:offload).
          if bits == 32 and p == 1:
            found.append(Recipe(precision, bits, stage, t, remat, m, p, pm, offload=True,
                                context=c, context_attention=method))
  return found


def evaluate(config, recipe: Recipe, target: Target, backend: str = 'gpu') -> Candidate:
  """A recipe's estimated bytes (as `backend`'s compiler holds them) and step time."""
  cfg = checks.model_config(config)
  policy = get_policy(recipe.precision)
  dp = target.count // (recipe.tensor * recipe.stages * recipe.context)
  shape = StepShape(rows_per_device=config.train.batch_size // (dp * recipe.microbatches),
                    seq_len=config.train.seq_len,
                    fsdp=1 if recipe.zero_stage == 0 else dp * recipe.context,
                    context=recipe.context, tensor=recipe.tensor, zero_stage=recipe.zero_stage,
                    data_parallel=dp * recipe.context,
                    microbatches=recipe.microbatches, adam_bits=recipe.adam_bits,
                    adam_block_size=config.quant.adam_block_size, stages=recipe.stages,
                    pipeline_microbatches=recipe.pipeline_microbatches, schedule=recipe.schedule,
                    repeats=recipe.repeats,
                    backend=backend, offload_optimizer=recipe.offload,
                    packed=bool(config.data.packing), device_memory=target.memory)
  cfg = dataclasses.replace(cfg, remat=recipe.remat, context_attention=recipe.context_attention)
  frozen = _frozen(config, recipe.precision)
  host = offloaded(cfg, policy, dataclasses.replace(shape, backend='gpu'), frozen)
  if recipe.offload and backend != 'gpu':   # the GPU estimate holds it in its update's phase
    host['streamed'] = streamed_state_bytes(cfg, policy, shape)
  reduces = checks.unbatchable_attention(config.data.packing, cfg.attention, policy.compute_dtype,
                                         'gpu', recipe.context)
  return Candidate(recipe, estimate(cfg, policy, shape, frozen),
                   step_seconds(cfg, recipe, config.train.batch_size, config.train.seq_len, target,
                                policy, base_trains=not config.lora.rank,
                                reduces_every_microbatch=reduces), host=host)


def host_fits(candidate: Candidate, target: Target) -> bool:
  """Whether the host memory of a node holds what its GPUs offload (under HOST_MARGIN)."""
  gpus = min(target.count, target.per_node)
  return candidate.host.get('total', 0) * gpus <= target.host_memory * (1 - HOST_MARGIN)


def keeps_fp32_update(candidate: Candidate) -> bool:
  return get_policy(candidate.recipe.precision).has_fp32_update


_FROZEN_CACHE: dict = {}


def _frozen(config, precision: str) -> Frozen | None:
  """A LoRA config's adapters and frozen base under `precision` (None without LoRA)."""
  if not config.lora.rank:
    return None
  key = (config.to_json(), precision)
  if key not in _FROZEN_CACHE:
    with_precision = ml_collections.ConfigDict(config.to_dict())
    with_precision.precision = precision
    spec = checks.model_spec(with_precision)
    _FROZEN_CACHE[key] = Frozen(*spec.sizes(), quantized=spec.base_format is not None)
  return _FROZEN_CACHE[key]


def plan(config, target: Target, compile_total, log=print, stages: bool = True,
         allow_pure_bf16: bool = False, backend: str = 'gpu') -> tuple[Candidate, list[Candidate]]:
  """(the chosen candidate, every candidate ranked). `compile_total(config) -> bytes` compiles a
  config's train step for the target (`backend`: the platform it compiles with, whose terms the
  estimate ranks with), or says why it could not (a string; a compile without a memory total is
  unverified, never fitting); `stages`: pipeline stages may be chosen (multi-node targets);
  `allow_pure_bf16`: recipes without an fp32 master may be chosen. Raises PlanError when nothing
  fits."""
  budget = target.memory * (1 - MARGIN)
  candidates = [evaluate(config, r, target, backend) for r in recipes(config, target, stages)]
  if not candidates:
    raise PlanError(f'no recipe can split batch {config.train.batch_size} over {target}: the '
                    f'global batch must divide over the data-parallel devices')
  fits = sorted((c for c in candidates if c.device_bytes <= budget and host_fits(c, target)),
                key=lambda c: c.seconds['total'])
  fitting = [c for c in fits if allow_pure_bf16 or keeps_fp32_update(c)]
  if fits and not fitting:
    raise PlanError(
        f'on {target} only recipes without an fp32 master fit (the fastest: {fits[0].recipe}, '
        f'{fits[0].device_bytes / 1e9:.1f} GB per device by the estimate): their optimizer '
        f'rounds every update to bf16; pass --plan_allow_pure_bf16 to accept that, or use more '
        f'devices')
  if not fitting:
    raise PlanError(nothing_fits(candidates, target, budget))
  log(f'{len(candidates)} recipes, {len(fitting)} fit by the estimate; compiling the fastest '
      f'to verify (at most {MAX_COMPILES})')
  tried = fitting[:MAX_COMPILES]
  for candidate in tried:
    started = time.time()
    compiled = compile_total(apply(config, candidate.recipe, target.count))
    candidate.compiled = _compiled_bytes(compiled)
    seconds = f'{time.time() - started:.1f} s'
    if isinstance(candidate.compiled, str):
      log(f'  {candidate.recipe}: {candidate.compiled} ({seconds})')
      continue
    verdict = 'fits' if candidate.compiled <= budget else 'does NOT fit'
    log(f'  {candidate.recipe}: estimate {candidate.device_bytes / 1e9:.1f} GB, compiled '
        f'{candidate.compiled / 1e9:.1f} GB per device: {verdict} ({seconds})')
    if candidate.compiled <= budget:
      note = tradeoff(candidate, fits, budget)
      if note:
        log(note)
      return candidate, fitting
  failed = [c for c in tried if isinstance(c.compiled, str)]
  if len(failed) == len(tried):
    raise PlanError(f'none of the {len(tried)} fastest recipes the estimate accepted on {target} '
                    f'could be verified: {failed[0].recipe}: {failed[0].compiled}')
  also = f', {len(failed)} could not be verified' if failed else ''
  raise PlanError(f'the {len(tried)} fastest recipes the estimate accepted on {target}: '
                  f'{len(tried) - len(failed)} compile above the {budget / 1e9:.1f} GB '
                  f'usable{also}; the estimate is too optimistic here')


def nothing_fits(candidates: list[Candidate], target: Target, budget: float) -> str:
  """Why no recipe fits the target, by the estimate: the device memory of every recipe, or the
  host memory of those whose device memory fits (offloaded state)."""
  host_budget = target.host_memory * (1 - HOST_MARGIN)
  per_node = min(target.count, target.per_node)
  on_device = [c for c in candidates if c.device_bytes <= budget]
  if on_device:   # each fits the device, and offloads more than a node's host memory holds
    closest = min(on_device, key=lambda c: c.host.get('total', 0))
    need = closest.host.get('total', 0) * per_node
    return (f'nothing fits {target}: the recipes that fit the device memory offload too much; the '
            f'smallest ({closest.recipe}) needs an estimated {need / 1e9:.0f} GB of host memory per '
            f'node, {need / host_budget:.2f}x the {host_budget / 1e9:.0f} GB usable '
            f'({target.host_memory / 1e9:.0f} GB less {HOST_MARGIN:.0%}); use nodes with more host '
            f'memory, or more devices')
  closest = min(candidates, key=lambda c: c.device_bytes)
  need = closest.device_bytes
  return (f'nothing fits {target}: the smallest recipe ({closest.recipe}) needs an estimated '
          f'{need / 1e9:.1f} GB per device, {need / budget:.2f}x the {budget / 1e9:.1f} GB usable '
          f'({target.memory / 1e9:.3g} GB less {MARGIN:.0%} margin); use about '
          f'{math.ceil(need / budget * 10) / 10:.1f}x as many devices or a larger GPU')


def _compiled_bytes(total) -> int | float | str:
  """A compile's per-device bytes, or why there are none: `compile_total` answers a number or a
  reason, and a compile whose memory total is unavailable (None) is a reason too, never a size."""
  if isinstance(total, str) or (isinstance(total, (int, float)) and not isinstance(total, bool)):
    return total
  return f'compiled, but no per-device memory total was reported ({total!r})'


def assumptions(target: Target) -> str:
  return (f'assumptions: {target}: {target.memory / 1e9:.3g} GB, {target.peak_bf16 / 1e12:.0f} '
          f'TFLOP/s bf16 peak at {MFU_ASSUMED:.0%} MFU, HBM {target.hbm / 1e12:.2f} TB/s, '
          f'{target.intra_node / 1e9:.0f} GB/s intra-node and {target.inter_node / 1e9:.1f} GB/s '
          f'inter-node per GPU, {target.per_node} GPUs per node, host link '
          f'{target.host_link / 1e9:.1f} GB/s per GPU, {target.host_memory / 1e9:.0f} GB host memory '
          f'per node; a recipe fits under {1 - MARGIN:.0%} of the device memory and '
          f'{1 - HOST_MARGIN:.0%} of the host\'s; data-parallel collectives overlap with compute, '
          f'tensor-parallel ones and host transfers do not (plan/cost.py)')


def tradeoff(chosen: Candidate, candidates: list[Candidate], budget: float) -> str | None:
  """What keeping an fp32 master cost against the fastest pure-bf16 recipe that fits, or None
  when no such recipe is at least 1 % faster by the model (the chosen one being pure bf16 itself
  is said as such)."""
  if not keeps_fp32_update(chosen):
    return (f'quality: {chosen.recipe.precision} updates bf16 weights directly (allowed by '
            f'--plan_allow_pure_bf16): a step below half a bf16 spacing of a weight is lost')
  pure = [c for c in candidates if not keeps_fp32_update(c) and c.device_bytes <= budget]
  if not pure:
    return None
  best = min(pure, key=lambda c: c.seconds['total'])
  if best.seconds['total'] * 1.01 > chosen.seconds['total']:
    return None
  return (f'quality: kept an fp32 master ({chosen.recipe.precision}, '
          f'{chosen.seconds["total"]:.2f} s per step) over the fastest pure-bf16 recipe '
          f'({best.recipe}, {best.seconds["total"]:.2f} s, '
          f'{chosen.seconds["total"] / best.seconds["total"] - 1:.0%} faster by the model), whose '
          f'updates below half a bf16 spacing of a weight round away; --plan_allow_pure_bf16 '
          f'lets the plan take it')
