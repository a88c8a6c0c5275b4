"""Config validation: every bad value gets one line naming it and what is allowed, before any
compile and before anything in the workdir is touched."""
import dataclasses

import jax
from flax import nnx

from models import ModelConfig, Transformer
from models.attention import refusal as attention_refusal
from models.attention import resolve as resolve_attention
from models.lora import LoraSpec, check_targets
from optim.adam8bit import BLOCK_SIZES
from optim.adamw import ADAM_BITS
from parallel import stage_layers
from parallel.pipeline import PipelineSchedule
from parallel.rules import layout_rules
from precision.policy import Policy, get_policy
from quant.recipe import MatmulRecipe
from quant.weights import WEIGHT_FORMATS
from train.state import ModelSpec


class ConfigError(ValueError):
  pass


# A vocabulary taken from a tokenizer is padded to a multiple of this (as Megatron-LM's
# --make-vocab-size-divisible-by): it splits evenly over tensor-parallel ways up to 128, and keeps
# the embedding's and head's matmuls on aligned shapes.
VOCAB_MULTIPLE = 128


def follow_tokenizer(config) -> tuple:
  """(`config`, the tokenizer's vocabulary size). The config has `model.vocab_size` set to the
  tokenizer's vocabulary padded to VOCAB_MULTIPLE where the run uses a tokenizer of its own
  (`data.tokenizer` not 'bytes') and imports no model (`init_from` empty: an imported model keeps
  its vocabulary); the byte tokenizer keeps the preset's vocabulary, so that the presets keep the
  shapes of the models they are named after. A changed config is a copy. DataError in one line
  for a tokenizer that does not open."""
  from data.prepare import open_tokenizer
  tokenizer_vocab = open_tokenizer(config.data.tokenizer).vocab_size
  if config.data.tokenizer in ('', 'bytes') or config.get('init_from', ''):
    return config, tokenizer_vocab
  padded = -(-tokenizer_vocab // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
  if config.model.vocab_size == padded:
    return config, tokenizer_vocab
  config = config.copy_and_resolve_references()
  config.model.vocab_size = padded
  return config, tokenizer_vocab


def model_config(config) -> ModelConfig:
  try:
    return ModelConfig.from_config(config.model)
  except (TypeError, ValueError) as e:
    raise ConfigError(str(e)) from None


def policy(config, platform: str | None = None) -> Policy:
  """The precision policy with the matmul recipe of `quant.*` inside it, for a step compiled for
  `platform` (default: JAX's backend)."""
  try:
    recipe = MatmulRecipe.from_config(config.quant)
    recipe.check_inputs(model_config(config).matmul_inputs())
    policy = get_policy(config.precision)
    if recipe.delayed_scaling and policy.loss_scaling:
      raise ValueError(f'quant.fp8_scaling=delayed cannot run under precision={policy.name!r}: its '
                       f'history updates travel with the gradients, which loss scaling rescales; '
                       f'use precision bf16_mixed or bf16')
    refused = attention_refusal(config.model.get('attention', 'auto'), policy.compute_dtype,
                                platform or jax.default_backend())
    if refused:
      raise ValueError(refused)
    return dataclasses.replace(policy, matmul=recipe)
  except ValueError as e:
    raise ConfigError(str(e)) from None


def adapters(config) -> LoraSpec | None:
  """The LoRA adapters `lora.*` asks for (None: lora.rank=0, every weight trains)."""
  lora = config.lora
  if lora.rank == 0:
    return None
  spec = LoraSpec(rank=lora.rank, alpha=float(lora.alpha), dropout=float(lora.dropout),
                  targets=lora.targets)
  try:
    spec.check()
  except ValueError as e:
    raise ConfigError(str(e)) from None
  return spec


def model_spec(config, platform: str | None = None) -> ModelSpec:
  """The model, its precision, adapters and frozen-base storage, checked for a step compiled for
  `platform` (default: JAX's backend): a LoRA target regex that matches no dense layer is refused
  naming some that exist."""
  model, precision, lora = model_config(config), policy(config, platform), adapters(config)
  base = config.quant.weights
  if base not in ('none',) + WEIGHT_FORMATS:
    raise ConfigError(f'quant.weights={base!r}; allowed: none, {", ".join(WEIGHT_FORMATS)}')
  if base != 'none' and lora is None:
    raise ConfigError(f'quant.weights={base!r} stores the base frozen, so only adapters can train; '
                      f'set lora.rank > 0 (QLoRA) or quant.weights=none')
  if base != 'none' and precision.matmul.mode != 'none':
    raise ConfigError(f'quant.weights={base!r} (a quantized frozen base) with quant.mode='
                      f'{precision.matmul.mode!r}; choose one: quant.mode=none for QLoRA')
  if lora is not None:
    if precision.matmul.learned_scale:
      raise ConfigError('quant.learned_scale trains step sizes of the base weights, which LoRA '
                        'freezes; use it without lora.rank')
    try:
      check_targets(nnx.eval_shape(lambda: Transformer(model, policy=precision,
                                                       rngs=nnx.Rngs(0))), lora)
    except ValueError as e:
      raise ConfigError(str(e)) from None
  return ModelSpec(model, precision, config.train.seed, lora, None if base == 'none' else base)


def check_config(config, *, data_parallel: int, process_count: int, tokenizer_vocab: int,
                 context: int = 1) -> None:
  """Shape checks that need to know how many ways the batch is split. `process_count`: the
  processes that feed distinct rows (parallel/sharding.py:process_feed); `context`: the shards of
  each sequence (mesh.context)."""
  model, train = model_config(config), config.train
  for key in ('steps', 'batch_size', 'seq_len', 'microbatches', 'log_every', 'eval_every',
              'eval_tokens', 'checkpoint_every', 'keep_checkpoints', 'max_bad_steps'):
    value = train[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ConfigError(f'train.{key}={value!r}; it must be a positive integer')
  ranges = {  # key: (test, what is allowed)
      'learning_rate': (lambda v: v > 0, 'a positive number'),
      'warmup_steps': (lambda v: isinstance(v, int) and v >= 0, 'an integer >= 0'),
      'min_lr_ratio': (lambda v: 0 <= v <= 1, 'a number in [0, 1]'),
      'weight_decay': (lambda v: v >= 0, 'a number >= 0'),
      'b1': (lambda v: 0 <= v < 1, 'a number in [0, 1)'),
      'b2': (lambda v: 0 <= v < 1, 'a number in [0, 1)'),
      'grad_clip': (lambda v: v > 0, 'a positive number'),
      'checkpoint_minutes': (lambda v: v >= 0,
                             'a number of minutes >= 0 (0: off)'),
  }
  for key, (ok, allowed) in ranges.items():
    value = train[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
      raise ConfigError(f'train.{key}={train[key]!r}; it must be {allowed}')
  if not isinstance(config.data.packing, bool):
    raise ConfigError(f'data.packing={config.data.packing!r}; it must be True (several documents '
                      'per row, kept apart) or False (one document per row, padded)')
  sample = config.sample
  if not sample.prompt or not isinstance(sample.length, int) or sample.length < 0 \
      or sample.temperature < 0:
    raise ConfigError(f'sample={sample.to_dict()}; the prompt must be non-empty, the length an '
                      f'integer >= 0 and the temperature >= 0 (0 = greedy)')
  if train.seq_len > model.max_seq_len:
    raise ConfigError(f'train.seq_len={train.seq_len} is above the model maximum '
                      f'model.max_seq_len={model.max_seq_len}; use at most {model.max_seq_len}')
  if context > 1 and train.seq_len % (2 * context):
    raise ConfigError(f'train.seq_len={train.seq_len} does not split over mesh.context={context}: '
                      f'each sequence is cut into 2 x {context} = {2 * context} equal chunks (two '
                      f'per shard, models/context.py); use a multiple of {2 * context}')
  if model.vocab_size < tokenizer_vocab:
    raise ConfigError(f'model.vocab_size={model.vocab_size} is smaller than the tokenizer\'s '
                      f'{tokenizer_vocab} tokens; use at least {tokenizer_vocab}')
  per_step = data_parallel * train.microbatches
  if train.batch_size % per_step:
    raise ConfigError(
        f'train.batch_size={train.batch_size} is not divisible by {data_parallel} data-parallel '
        f'devices x train.microbatches={train.microbatches} = {per_step}; use a multiple of {per_step}')
  if train.batch_size % process_count:
    raise ConfigError(f'train.batch_size={train.batch_size} is not divisible by the '
                      f'{process_count} processes that feed distinct rows; use a multiple of '
                      f'{process_count}')
  if config.quant.adam_bits not in ADAM_BITS:
    raise ConfigError(f'quant.adam_bits={config.quant.adam_bits!r}; allowed: '
                      f'{", ".join(map(str, ADAM_BITS))}')
  if config.quant.adam_block_size not in BLOCK_SIZES:
    raise ConfigError(f'quant.adam_block_size={config.quant.adam_block_size!r}; allowed: '
                      f'{", ".join(map(str, BLOCK_SIZES))}')
  try:
    layout_rules(config.parallel.zero_stage)
  except ValueError as e:
    raise ConfigError(str(e)) from None
  if not 0 < config.data.val_fraction <= 0.5:
    raise ConfigError(f'data.val_fraction={config.data.val_fraction!r}; allowed: (0, 0.5]')


def host_memory_refusal(what: str, kinds: list[str] | None = None,
                        platform: str | None = None, device=None) -> str | None:
  """Why `what` (a config key asking for host memory) cannot run here, or None: the devices
  (`device`, default this process's first; or their memory `kinds` and `platform`) must offer
  JAX's `pinned_host` memory kind (CPU and GPU do, with jax >= 0.4.31). A compile-only GPU
  (`--target`) lists no memories: its host placements are written over the abstract mesh
  (train/state.py:in_host_memory)."""
  if kinds is None:
    device = device or jax.devices()[0]
    kinds, platform = [m.kind for m in device.addressable_memories()], device.platform
    if not kinds and platform == 'gpu':
      return None
  if 'pinned_host' in kinds:
    return None
  return (f'{what} needs host memory (JAX memory kind pinned_host), which {platform} devices '
          f'under jax {jax.__version__} do not offer (they have: {", ".join(kinds)}); set it to '
          f'False')


OFFLOAD_UPDATES = ('device', 'host')   # parallel.offload_update: where the offloaded update runs


def offload_update(config) -> str:
  """Where the offloaded optimizer's update runs (`parallel.offload_update`): a config saved
  before the key existed streams it through the device."""
  return config.parallel.get('offload_update', 'device')


def offload(config, *, stages: int, device=None) -> None:
  """`parallel.offload_*`: booleans, on devices with host memory (`device`'s: default this
  process's), with what they stream."""
  # A config saved before these keys existed (a run's config.json, a planned config) has neither.
  offloads = {key: config.parallel.get(key, False) for key in ('offload_optimizer', 'offload_frozen')}
  for key, value in offloads.items():
    if not isinstance(value, bool):
      raise ConfigError(f'parallel.{key}={value!r}; it must be True or False')
    if value and (refused := host_memory_refusal(f'parallel.{key}=True', device=device)):
      raise ConfigError(refused)
  if offloads['offload_optimizer']:
    if config.quant.adam_bits == 8:
      raise ConfigError('parallel.offload_optimizer=True with quant.adam_bits=8: 8-bit moments are '
                        'blocked across layers, and the offloaded update streams one layer at a '
                        'time; use quant.adam_bits=32 (or offload off)')
    if stages > 1:
      raise ConfigError(f'parallel.offload_optimizer=True with mesh.stage={stages}: the offloaded '
                        f'update streams layers one at a time, which a pipeline splits over '
                        f'devices; use mesh.stage=1 (or offload off)')
  where = offload_update(config)
  if where not in OFFLOAD_UPDATES:
    raise ConfigError(f'parallel.offload_update={where!r}; it must be one of '
                      f'{", ".join(map(repr, OFFLOAD_UPDATES))}')
  if where == 'host' and not offloads['offload_optimizer']:
    raise ConfigError("parallel.offload_update='host' but parallel.offload_optimizer=False: only "
                      "an optimizer state in host memory is updated there; set "
                      "parallel.offload_optimizer=True (or offload_update='device')")
  if offloads['offload_frozen'] and config.lora.rank == 0:
    raise ConfigError('parallel.offload_frozen=True but nothing is frozen (lora.rank=0); set '
                      'lora.rank > 0 (LoRA/QLoRA) or offload_frozen=False')


def unbatchable_attention(packing: bool, attention: str, compute_dtype, platform: str,
                          context: int = 1) -> bool:
  """Whether the step runs JAX's cuDNN attention on packed rows, which no `vmap` may batch: its
  batching rule reshapes the rows' segment mask to one per head, and the step does not compile
  (jax 0.10.2 and 0.11.2: 7b on 4 stages of H100s; jax 0.10.2: 1b data-parallel over 8 H100s in
  8 microbatches). Split over `context` devices the attention is the context kernel, not cuDNN's.
  The step (per-device accumulation, pipelines) and the planner's cost of it read this."""
  chosen = resolve_attention(attention, compute_dtype, platform)
  return bool(packing) and chosen == 'cudnn' and context == 1


def pipelined_attention(config, spec: ModelSpec, *, schedule: PipelineSchedule | None,
                        platform: str) -> ModelSpec:
  """The spec with the attention a pipeline can run. A pipeline batches its stages with `vmap`,
  which JAX's cuDNN attention with a segment mask cannot take (`unbatchable_attention`); the
  zero-bubble schedule runs its stages in a `shard_map`, inside which cuDNN's custom partitioning
  fails whatever the rows (jax 0.10.2, 1b ZB-H1 on 8 H100s: "'GSPMDSharding' object has no
  attribute 'spec'"). There `auto` is the flash kernel, and `cudnn` itself is refused."""
  if schedule is None or resolve_attention(spec.config.attention, spec.policy.compute_dtype,
                                           platform) != 'cudnn':
    return spec
  manual = bool(schedule.zero_bubble)
  if not manual and not unbatchable_attention(config.data.packing, spec.config.attention,
                                              spec.policy.compute_dtype, platform):
    return spec
  if spec.config.attention == 'cudnn':
    why = (f"with parallel.pipeline_schedule='zb_h1': JAX's cuDNN attention cannot be partitioned "
           f"inside that schedule's shard_map over the stages; use 'auto' or 'flash', or another "
           f"schedule" if manual else
           f"with mesh.stage={schedule.stages} and data.packing=True: JAX's cuDNN attention cannot "
           f"take packed rows' segment mask inside a pipeline (its batching over the stages does not "
           f"compile); use 'auto' or 'flash', or data.packing=False")
    raise ConfigError(f"model.attention='cudnn' {why}")
  return dataclasses.replace(spec, config=dataclasses.replace(spec.config, attention='flash'))


def pipeline_schedule(config, *, stages: int, data_parallel: int) -> PipelineSchedule | None:
  """The pipeline `mesh.stage` and `parallel.pipeline_*` ask for (None: one stage), checked
  against the model's depth and the batch (after `check_config`)."""
  if stages == 1:
    return None
  parallel, train = config.parallel, config.train
  num_layers, counts = model_config(config).num_layers, parallel.get('pipeline_stage_layers', '')
  schedule = PipelineSchedule(parallel.pipeline_schedule, stages, parallel.pipeline_microbatches,
                              parallel.pipeline_repeats)
  refused = (schedule.refusal(num_layers, train.batch_size // (data_parallel * train.microbatches))
             or stage_layers.refusal(counts, num_layers, stages, schedule.repeats))
  if refused:
    raise ConfigError(refused)
  schedule = dataclasses.replace(schedule, chunk_layers=stage_layers.parse(counts))
  if config.quant.get('weights', 'none') != 'none' and num_layers % stages:
    raise ConfigError(f'quant.weights={config.quant.weights!r} with model.num_layers={num_layers} on '
                      f'mesh.stage={stages}: a quantized frozen base is split over the stages only '
                      f'where they divide the layers; use such a layer count or stage count')
  if parallel.get('pipeline_gather_once', False) and schedule.backward_in_loop:
    raise ConfigError(f'parallel.pipeline_gather_once=True with parallel.pipeline_schedule='
                      f'{schedule.name!r}: that schedule always gathers ZeRO-3\'s weights once per '
                      'step; the switch is for gpipe and circular (leave it False)')
  if parallel.get('pipeline_gather_once', False) and parallel.zero_stage != 3:
    raise ConfigError(f'parallel.pipeline_gather_once=True with parallel.zero_stage='
                      f'{parallel.zero_stage}: below ZeRO-3 the weights are whole already; it '
                      'gathers ZeRO-3\'s (set parallel.zero_stage=3, or leave it False)')
  if MatmulRecipe.from_config(config.quant).delayed_scaling:
    raise ConfigError('quant.fp8_scaling=delayed with mesh.stage > 1: a pipeline runs each layer '
                      'once per microbatch and on bubble inputs, which its amax history would '
                      'record; use quant.fp8_scaling=current')
  return schedule
