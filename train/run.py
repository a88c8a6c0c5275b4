"""A training run, top to bottom: check the config, read the data, build the mesh and the state's
layout, compile the step (and record its memory), create or restore the state, train, evaluate,
checkpoint, and print a sample. `--dry_run` stops after the compile."""
import contextlib
import dataclasses
import json
import os
import time

import jax
import numpy as np
from flax import linen
from tqdm import tqdm

import data as data_lib
from memory.compiled import compiled_memory, format_bytes, peak_device_memory
from memory.estimate import Frozen, StepShape, estimate
from models.config import ModelConfig
from parallel.collectives import collective_stats
from parallel.mesh import data_parallel_size, make_mesh
from parallel.rules import DATA_PARALLEL_AXES, layout_rules
from parallel.sharding import batch_sharding, replicated
from quant.precision import Policy
from quant.recipe import describe as describe_recipe
from train import checks, init_from
from train.checkpoint import Checkpointer
from train.evaluate import evaluate, make_eval_step
from train.metrics import MetricsWriter
from train.optimizer import learning_rate_schedule, make_optimizer
from train.sample import generate
from train.state import ModelSpec, StateLayout, moment_block_axes, state_layout
from train.step import make_train_step


@dataclasses.dataclass
class Setup:
  config: object
  spec: ModelSpec           # the model, its precision, adapters and frozen-base storage
  model: ModelConfig
  policy: Policy
  mesh: jax.sharding.Mesh
  rules: object             # parallel.rules.LayoutRules
  layout: StateLayout
  train_step: object        # jitted, with shardings and donation
  batch_sharding: jax.sharding.NamedSharding

  def context(self):
    """Trace-time context: the mesh, and the rules that turn activation hints into shardings."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(linen.logical_axis_rules(self.rules.activations))
    return stack


def _is_main() -> bool:
  return jax.process_index() == 0


def setup(config, devices=None) -> Setup:
  """Validate and lay out everything; allocates nothing. `devices`: default all of them."""
  spec = checks.model_spec(config)
  model, policy = spec.config, spec.policy
  try:
    mesh = make_mesh(dict(config.mesh), devices)
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None
  checks.check_config(config, data_parallel=data_parallel_size(mesh),
                      process_count=jax.process_count(),
                      tokenizer_vocab=make_tokenizer(config).vocab_size)
  rules = layout_rules(config.parallel.zero_stage)
  block_axes = moment_block_axes(spec, mesh, rules) if config.quant.adam_bits == 8 else None
  tx = make_optimizer(config.train, config.quant.adam_bits, config.quant.adam_block_size,
                      amax_histories=policy.matmul.delayed_scaling, block_axes=block_axes)
  try:
    layout = state_layout(spec, tx, mesh, rules)
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None
  # Per-device accumulation needs more than one data-parallel device (with one there is nothing to
  # reduce, and XLA refuses the all-reduce of a manual shard_map over an axis of size 1 beside a
  # tensor axis).
  local = ((mesh, DATA_PARALLEL_AXES, rules.per_device_activations)
           if rules.grads_replicated and data_parallel_size(mesh) > 1 else None)
  dropout = spec.adapters is not None and spec.adapters.dropout > 0
  step_fn = make_train_step(layout.graphdef, tx, policy, config.train.microbatches,
                            layout.grad_shardings, local,
                            dropout_seed=config.train.seed if dropout else None)
  tokens_sharding = batch_sharding(mesh, rules.activations)
  batch_shardings = {'inputs': tokens_sharding, 'targets': tokens_sharding}
  train_step = jax.jit(step_fn, in_shardings=(layout.shardings, batch_shardings),
                       out_shardings=(layout.shardings, replicated(mesh)), donate_argnums=0)
  return Setup(config, spec, model, policy, mesh, rules, layout, train_step, tokens_sharding)


def compile_train_step(s: Setup):
  """Lower and compile on abstract inputs: nothing is allocated, the memory can be read."""
  train = s.config.train
  batch = jax.ShapeDtypeStruct((train.batch_size, train.seq_len), np.int32, sharding=s.batch_sharding)
  with s.context():
    return s.train_step.lower(s.layout.abstract, {'inputs': batch, 'targets': batch}).compile()


def memory_report(s: Setup, compiled) -> dict:
  train = s.config.train
  rows = train.batch_size // (data_parallel_size(s.mesh) * train.microbatches)
  shape = StepShape(rows, train.seq_len, fsdp=s.mesh.shape['fsdp'], tensor=s.mesh.shape['tensor'],
                    zero_stage=s.config.parallel.zero_stage, microbatches=train.microbatches,
                    adam_bits=s.config.quant.adam_bits,
                    adam_block_size=s.config.quant.adam_block_size,
                    backend=s.mesh.devices.flat[0].platform)
  trainable, base = s.spec.sizes()
  frozen = (Frozen(trainable, base, quantized=s.spec.base_format is not None)
            if 'frozen' in s.layout.abstract else None)
  return {
      'num_params': s.model.num_params,
      'trainable_params': trainable,
      'frozen_bytes': base,
      'mesh': dict(s.mesh.shape),
      'zero_stage': s.config.parallel.zero_stage,
      'per_device_bytes': compiled_memory(compiled),
      'estimate_bytes': estimate(s.model, s.policy, shape, frozen),
      # What the same step needs on a GPU by the same model (no XLA:CPU fp32 copies): the figure
      # to plan with when the compile ran on the CPU. Not checked against a GPU compile here.
      'estimate_gpu_bytes': estimate(s.model, s.policy, dataclasses.replace(shape, backend='gpu'),
                                     frozen),
      'collectives_per_step': collective_stats(compiled.as_text(), s.mesh.size),
  }


def print_summary(s: Setup, memory: dict) -> None:
  if not _is_main():
    return
  compiled, estimated = memory['per_device_bytes'], memory['estimate_bytes']
  devices = jax.devices()
  print(f'config      {s.config.name}  (precision {s.policy.name}: {s.policy.description})')
  quant = s.config.quant
  print(f'quant       matmuls {describe_recipe(s.policy.matmul)}; Adam moments {quant.adam_bits}-bit')
  print(f'devices     {len(devices)} x {devices[0].platform} in {jax.process_count()} process(es); '
        f'mesh {dict(s.mesh.shape)}')
  print(f'model       {s.model.num_params / 1e6:.2f} M parameters, {s.model.num_layers} layers, '
        f'd_model {s.model.d_model}, remat {s.model.remat}')
  adapters = s.spec.adapters
  if adapters is not None:
    storage = s.spec.base_format or f'{jax.numpy.dtype(s.policy.compute_dtype).name} matrices'
    print(f'lora        rank {adapters.rank}, alpha {adapters.alpha:g}, dropout {adapters.dropout:g} '
          f'on {adapters.targets!r}; trainable {memory["trainable_params"] / 1e6:.3f} M of '
          f'{s.model.num_params / 1e6:.2f} M parameters; frozen base {format_bytes(memory["frozen_bytes"])}'
          f' ({storage})')
    if not s.config.init_from:
      print('note        no init_from: the adapters adapt a randomly initialised base; fine-tune '
            'a checkpoint with --config.init_from=hf:DIR or run:DIR')
  print(f'layout      zero_stage {s.config.parallel.zero_stage}; batch {s.config.train.batch_size} '
        f'sequences x {s.config.train.seq_len} tokens in {s.config.train.microbatches} microbatch(es)')
  b = format_bytes
  print(f'memory      per device, compiled: {b(compiled["total"])} = arguments '
        f'{b(compiled["arguments"])} + outputs {b(compiled["outputs"])} - donated '
        f'{b(compiled["aliased"])} + temp {b(compiled["temp"])}')
  print(f'            per device, estimate: {b(estimated["total"])} = params {b(estimated["params"])}'
        f' + grads {b(estimated["grads"])} + optimizer {b(estimated["optimizer"])} + activations '
        f'{b(estimated["activations"])} + temporaries {b(estimated["temporaries"])}'
        + ''.join(f' + {k} {b(estimated[k])}' for k in ('update', 'moment_fp32') if estimated.get(k)))
  if s.mesh.devices.flat[0].platform == 'cpu':
    print(f'            on a GPU, estimate: {b(memory["estimate_gpu_bytes"]["total"])} (without '
          f'XLA:CPU\'s fp32 copies of bf16 matmul operands)')
  active = {k: v for k, v in memory['collectives_per_step'].items() if v['count']}
  print('collectives per step per device: ' + ('; '.join(
      f'{k} {v["count"]} ops, {b(v["bytes"])} in all' for k, v in active.items()) or 'none'))
  if s.config.parallel.zero_stage and s.mesh.shape['fsdp'] == 1:
    print(f'note        zero_stage {s.config.parallel.zero_stage} shards over the fsdp axis, which '
          f'has size 1 here: nothing is sharded (set --config.mesh.fsdp)')


def _write_json(path: str, value) -> None:
  if _is_main():
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(value, f, indent=2, sort_keys=True)
      f.write('\n')


def _open_source(config):
  """The init_from source, with the model shape taken from it (before anything is built)."""
  source = init_from.open_source(config)
  if source is not None:
    init_from.apply_model_fields(config, source)
  return source


def dry_run(config, workdir: str) -> dict:
  source = _open_source(config)
  s = setup(config)
  if source is not None:
    init_from.check_source(s, source)
  data_lib.list_files(config.data.path)   # a bad glob fails now, not when the real run starts
  checkpoints, _ = _existing_checkpoints(s, workdir)   # nor may it overwrite another model's memory.json
  if checkpoints:
    checkpoints.close()
  memory = memory_report(s, compile_train_step(s))
  print_summary(s, memory)
  os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, 'memory.json'), memory)
  return memory


def make_tokenizer(config):
  """`data.tokenizer`, or DataError in one line."""
  try:
    return data_lib.make_tokenizer(config.data.tokenizer)
  except ValueError as e:
    raise data_lib.DataError(str(e)) from None


def load_data(config):
  """(tokenizer, train tokens, validation tokens, validation bytes per token)."""
  root, files = data_lib.list_files(config.data.path)
  train_files, val_files = data_lib.split_files(root, files, config.data.val_fraction)
  tokenizer = make_tokenizer(config)
  val_tokens = data_lib.load_tokens(val_files, tokenizer)
  # The byte tokenizer's token is one byte; another's average is measured on the validation text.
  bytes_per_token = (1.0 if isinstance(tokenizer, data_lib.ByteTokenizer) else
                     len(data_lib.load_tokens(val_files)) / max(len(val_tokens), 1))
  return tokenizer, data_lib.load_tokens(train_files, tokenizer), val_tokens, bytes_per_token


def _global_batch(s: Setup, local: dict) -> dict:
  """Each process contributes its own rows; the result is one global array per key."""
  return {k: jax.make_array_from_process_local_data(s.batch_sharding, v) for k, v in local.items()}


def train_and_evaluate(config, workdir: str) -> dict:
  """Train (or resume) in `workdir`; returns the last evaluation."""
  source = _open_source(config)
  s = setup(config)
  train = config.train
  tokenizer, train_tokens, val_tokens, bytes_per_token = load_data(config)
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  batches = data_lib.TokenBatches(train_tokens, seq_len=train.seq_len,
                                  global_batch_size=train.batch_size, seed=train.seed, **process)
  eval_batches = [_global_batch(s, b) for b in data_lib.eval_batches(
      val_tokens, seq_len=train.seq_len, batch_size=train.batch_size,
      num_batches=train.eval_batches, **process)]

  checkpoints, start = _existing_checkpoints(s, workdir)
  if start is not None:   # refuse a checkpoint of another model or data stream before any write
    batches.set_state(checkpoints.restore_data(start))
  elif source is not None:   # and a source whose tensors disagree with the model
    init_from.check_source(s, source)

  compiled = compile_train_step(s)
  memory = memory_report(s, compiled)
  print_summary(s, memory)
  os.makedirs(workdir, exist_ok=True)
  _write_json(os.path.join(workdir, 'config.json'), config.to_dict())
  _write_json(os.path.join(workdir, 'memory.json'), memory)

  if start is None:
    checkpoints = checkpoints or Checkpointer(os.path.join(workdir, 'checkpoints'),
                                              keep=train.keep_checkpoints)
    state, start = (s.layout.init() if source is None else init_from.initial_state(s, source)), 0
    if source is not None and _is_main():
      print(f'init        base weights from {source.description}')
  else:
    state = checkpoints.restore_state(start, s.layout.abstract)
    if _is_main():
      print(f'resumed     from step {start} in {checkpoints.directory}')

  with s.context():
    eval_step = jax.jit(make_eval_step(s.layout.graphdef),
                        in_shardings=(s.layout.shardings['params'],
                                      s.layout.shardings.get('frozen', {}),
                                      {'inputs': s.batch_sharding, 'targets': s.batch_sharding}),
                        out_shardings=replicated(s.mesh))
  metrics = MetricsWriter(workdir, enabled=_is_main())
  learning_rate = learning_rate_schedule(train)
  last_eval: dict = {}

  def run_eval(step: int) -> dict:
    with s.context():
      result = evaluate(eval_step, state['params'], eval_batches, frozen=state.get('frozen'),
                        bytes_per_token=bytes_per_token)
    if _is_main():
      tqdm.write(f'eval  step {step}: loss {result["eval_loss"]:.4f} nats/token, '
                 f'{result["eval_bits_per_byte"]:.4f} bits/byte, perplexity {result["eval_perplexity"]:.2f}')
    return result

  if start == 0:   # the untrained model's score, the baseline every later evaluation beats
    last_eval = run_eval(0)
    metrics.write(0, last_eval)
  bar = tqdm(total=train.steps, initial=start, disable=not _is_main(), unit='step',
             dynamic_ncols=True)
  # tokens/s counts step time only: evaluation and checkpoint saves are timed and left out.
  interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
  for step in range(start + 1, train.steps + 1):
    batch = _global_batch(s, next(batches))
    state, step_metrics = compiled(state, batch)
    interval_steps += 1
    last = step == train.steps
    evaluating = step % train.eval_every == 0 or last
    if evaluating or step % train.log_every == 0:
      values = jax.device_get(step_metrics)   # waits for the step: the interval is honest
      elapsed = time.perf_counter() - interval_start - paused
      row = {k: float(v) for k, v in values.items()}
      row['tokens_per_sec'] = interval_steps * batches.tokens_per_batch / elapsed
      row['learning_rate'] = float(learning_rate(step - 1))
      bar.set_postfix_str(f'loss {row["loss"]:.4f}, {row["tokens_per_sec"]:,.0f} tokens/s')
      interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
      if evaluating:
        last_eval = run_eval(step)
        row.update(last_eval)
      if last and peak_device_memory() is not None:
        row['peak_device_bytes'] = peak_device_memory()
      metrics.write(step, row)
    bar.update(1)
    if step % train.checkpoint_every == 0 or last:
      save_start = time.perf_counter()
      checkpoints.save(step, state, batches.get_state())
      paused += time.perf_counter() - save_start
    if evaluating:   # the evaluation (and any save) just done stays out of the next interval
      interval_start, paused = time.perf_counter(), 0.0
  bar.close()
  checkpoints.wait()
  checkpoints.close()
  metrics.close()
  peak = peak_device_memory()
  if peak is not None and _is_main():   # GPUs report it; beside the compiled and estimated figures
    _write_json(os.path.join(workdir, 'memory.json'), {**memory, 'peak_device_bytes': peak})
  _print_sample(s, state, tokenizer)
  return last_eval


def _existing_checkpoints(s: Setup, workdir: str) -> tuple[Checkpointer | None, int | None]:
  """The workdir's checkpoints and latest step, after checking they hold this model's shapes.
  Creates nothing when the workdir has no checkpoints yet."""
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return None, None
  checkpoints = Checkpointer(directory, keep=s.config.train.keep_checkpoints)
  start = checkpoints.latest_step()
  if start is not None:
    checkpoints.check_shapes(start, s.layout.abstract)
  return checkpoints, start


def _print_sample(s: Setup, state, tokenizer) -> None:
  """Every process runs the generation (the parameters span all of them); process 0 prints it."""
  sample = s.config.sample
  # No rules in context: a batch of one cannot be split over the data-parallel devices.
  tokens = generate(s.layout.graphdef, state['params'], tokenizer.encode(sample.prompt),
                    frozen=state.get('frozen'),
                    num_tokens=sample.length, window=s.config.train.seq_len,
                    temperature=sample.temperature, seed=s.config.train.seed,
                    vocab_limit=tokenizer.vocab_size)
  if _is_main():
    print(f'sample (prompt {sample.prompt!r}, temperature {sample.temperature}):')
    print(tokenizer.decode(tokens))
