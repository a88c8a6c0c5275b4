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
from models.config import COMPUTE_FIELDS, ModelConfig
from parallel.collectives import collective_stats
from parallel.mesh import data_parallel_size, make_mesh
from parallel.rules import DATA_PARALLEL_AXES, layout_rules
from parallel.sharding import batch_sharding, replicated
from quant.loss_scale import all_finite
from quant.precision import Policy
from quant.recipe import describe as describe_recipe
from train import checks, init_from
from train.checkpoint import Checkpointer, CheckpointError
from train.evaluate import evaluate, make_eval_step
from train.metrics import MetricsWriter
from train.optimizer import learning_rate_schedule, make_optimizer
from train.preemption import StopRequests
from train.sample import generate
from train.state import ModelSpec, StateLayout, moment_block_axes, state_layout
from train.step import make_train_step
from train.workdir_lock import workdir_lock


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
  block_axes: dict | None   # 8-bit Adam: parameter path -> the dimension its moments are blocked from

  def context(self):
    """Trace-time context: the mesh, and the rules that turn activation hints into shardings."""
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(self.mesh))
    stack.enter_context(linen.logical_axis_rules(self.rules.activations))
    return stack


def _is_main() -> bool:
  return jax.process_index() == 0


def setup(config, devices=None, stored_block_axes: dict | None = None) -> Setup:
  """Validate and lay out everything; allocates nothing. `devices`: default all of them.
  `stored_block_axes`: how a checkpoint's 8-bit moments are blocked (they keep that blocking on
  any mesh: re-blocking would change their values)."""
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
  block_axes = (_block_axes(moment_block_axes(spec, mesh, rules), stored_block_axes)
                if config.quant.adam_bits == 8 else None)
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
  return Setup(config, spec, model, policy, mesh, rules, layout, train_step, tokens_sharding,
               None if block_axes is None else _flat_paths(block_axes))


def _flat_paths(tree) -> dict:
  return {jax.tree_util.keystr(path, simple=True, separator='/'): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _block_axes(ideal, stored: dict | None):
  """This mesh's ideal blocking (the sharded dimension, train/state.py), or the checkpoint's where
  it has one for every parameter (an older or another model's checkpoint is refused later)."""
  paths = _flat_paths(ideal)
  if stored is None or set(stored) != set(paths):
    return ideal
  if _is_main() and any(stored[p] != a for p, a in paths.items()):
    print('note        8-bit Adam moments keep the blocking of the mesh that saved them (re-blocking '
          'would change their values); where this mesh shards them otherwise, the update reshards')
  treedef = jax.tree_util.tree_structure(ideal)
  return jax.tree_util.tree_unflatten(treedef, [stored[p] for p in paths])


def checkpoint_meta(s: Setup) -> dict:
  """What a checkpoint records about its state (train/checkpoint.py): the config fields that fix
  the arrays' meaning, and the 8-bit moments' blocking."""
  model = {k: v for k, v in s.config.model.to_dict().items() if k not in COMPUTE_FIELDS}
  meta = {'identity': {'model': model, 'lora': s.config.lora.to_dict(),
                       'quant': {'weights': s.config.quant.weights}}}
  if s.block_axes is not None:
    meta['adam_block_axes'] = s.block_axes
  return meta



def compile_train_step(s: Setup):
  """Lower and compile on abstract inputs: nothing is allocated, the memory can be read."""
  train = s.config.train
  batch = jax.ShapeDtypeStruct((train.batch_size, train.seq_len), np.int32, sharding=s.batch_sharding)
  with s.context():
    return s.train_step.lower(s.layout.abstract, {'inputs': batch, 'targets': batch}).compile()


def memory_report(s: Setup, compiled) -> dict:
  trainable, base = s.spec.sizes()
  return {
      'num_params': s.model.num_params,
      'trainable_params': trainable,
      'frozen_bytes': base,
      'mesh': dict(s.mesh.shape),
      'zero_stage': s.config.parallel.zero_stage,
      'per_device_bytes': compiled_memory(compiled),
      'estimate_bytes': estimated_bytes(s),
      # What the same step needs on a GPU by the same model (no XLA:CPU fp32 copies): the figure
      # to plan with when the compile ran on the CPU. Not checked against a GPU compile here.
      'estimate_gpu_bytes': estimated_bytes(s, backend='gpu'),
      'collectives_per_step': collective_stats(compiled.as_text(), s.mesh.size),
  }


def estimated_bytes(s: Setup, backend: str | None = None) -> dict:
  """The analytic model's bytes per device (memory/estimate.py) for this setup's step, on
  `backend` (default: the platform of the mesh's devices)."""
  train = s.config.train
  rows = train.batch_size // (data_parallel_size(s.mesh) * train.microbatches)
  shape = StepShape(rows, train.seq_len, fsdp=s.mesh.shape['fsdp'], tensor=s.mesh.shape['tensor'],
                    zero_stage=s.config.parallel.zero_stage, microbatches=train.microbatches,
                    adam_bits=s.config.quant.adam_bits,
                    adam_block_size=s.config.quant.adam_block_size,
                    backend=backend or s.mesh.devices.flat[0].platform)
  trainable, base = s.spec.sizes()
  frozen = (Frozen(trainable, base, quantized=s.spec.base_format is not None)
            if 'frozen' in s.layout.abstract else None)
  return estimate(s.model, s.policy, shape, frozen)


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
  checkpoints = _open_checkpoints(config, workdir)
  s = setup(config, stored_block_axes=_stored_block_axes(checkpoints))
  if source is not None:
    init_from.check_source(s, source)
  data_lib.list_files(config.data.path)   # a bad glob fails now, not when the real run starts
  with workdir_lock(workdir, enabled=_is_main()):
    if checkpoints:   # nor may it overwrite another model's memory.json
      _check_checkpoints(s, checkpoints)
      checkpoints.close()
    memory = memory_report(s, compile_train_step(s))
    print_summary(s, memory)
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


class NonFiniteError(RuntimeError):
  """The loss or gradients stayed non-finite for train.max_bad_steps steps in a row."""


def train_and_evaluate(config, workdir: str) -> dict:
  """Train (or resume) in `workdir`; returns the last evaluation."""
  source = _open_source(config)
  checkpoints = _open_checkpoints(config, workdir)
  s = setup(config, stored_block_axes=_stored_block_axes(checkpoints))
  tokenizer, train_tokens, val_tokens, bytes_per_token = load_data(config)
  with workdir_lock(workdir, enabled=_is_main()):
    return _train(s, source, checkpoints, workdir, tokenizer, train_tokens, val_tokens,
                  bytes_per_token)


def _train(s: Setup, source, checkpoints, workdir, tokenizer, train_tokens, val_tokens,
           bytes_per_token) -> dict:
  train = s.config.train
  process = dict(process_index=jax.process_index(), process_count=jax.process_count())
  batches = data_lib.TokenBatches(train_tokens, seq_len=train.seq_len,
                                  global_batch_size=train.batch_size, seed=train.seed, **process)
  eval_batches = [_global_batch(s, b) for b in data_lib.eval_batches(
      val_tokens, seq_len=train.seq_len, batch_size=train.batch_size,
      num_batches=train.eval_batches, **process)]

  resuming = checkpoints is not None and bool(checkpoints.steps())
  if resuming:   # refuse a checkpoint of another model before any compile or write
    _check_checkpoints(s, checkpoints)
  elif source is not None:   # and a source whose tensors disagree with the model
    init_from.check_source(s, source)

  compiled = compile_train_step(s)
  memory = memory_report(s, compiled)
  # The newest checkpoint that restores, before anything is written (a stream of other data is
  # refused, not skipped); none restoring is an error that leaves every file as it was.
  restored = checkpoints.restore_newest(s.layout.abstract, batches.set_state) if resuming else None
  print_summary(s, memory)
  _write_json(os.path.join(workdir, 'config.json'), s.config.to_dict())
  _write_json(os.path.join(workdir, 'memory.json'), memory)

  if restored is None:
    checkpoints = checkpoints or Checkpointer(os.path.join(workdir, 'checkpoints'),
                                              keep=train.keep_checkpoints)
    state, start = (s.layout.init() if source is None else init_from.initial_state(s, source)), 0
    if source is not None and _is_main():
      print(f'init        base weights from {source.description}')
  else:
    state, start = restored.state, restored.step
    if restored.broken:
      aside = checkpoints.set_aside([step for step, _ in restored.broken])
      if _is_main():
        print(f'checkpoint  moved the {len(restored.broken)} that did not restore to {aside}')
    if _is_main():
      print(f'resumed     from step {start} in {checkpoints.directory}')

  with s.context():
    eval_step = jax.jit(make_eval_step(s.layout.graphdef),
                        in_shardings=(s.layout.shardings['params'],
                                      s.layout.shardings.get('frozen', {}),
                                      {'inputs': s.batch_sharding, 'targets': s.batch_sharding}),
                        out_shardings=replicated(s.mesh))
    params_finite = jax.jit(all_finite)
  metrics = MetricsWriter(workdir, enabled=_is_main())
  learning_rate = learning_rate_schedule(train)
  last_eval: dict = {}
  meta = checkpoint_meta(s)

  def run_eval(step: int) -> dict:
    with s.context():
      result = evaluate(eval_step, state['params'], eval_batches, frozen=state.get('frozen'),
                        bytes_per_token=bytes_per_token)
    if _is_main():
      tqdm.write(f'eval  step {step}: loss {result["eval_loss"]:.4f} nats/token, '
                 f'{result["eval_bits_per_byte"]:.4f} bits/byte, perplexity {result["eval_perplexity"]:.2f}')
    return result

  def save(step: int) -> None:
    # Never a non-finite state (the step skips bad updates, so this is only a last guard).
    if not bool(params_finite(state['params'])):
      raise NonFiniteError(f'step {step}: the parameters hold an inf or nan, so they were not saved')
    checkpoints.save(step, state, batches.get_state(), meta)
    stops.saved()

  if start == 0:   # the untrained model's score, the baseline every later evaluation beats
    last_eval = run_eval(0)
    metrics.write(0, last_eval)
  bar = tqdm(total=train.steps, initial=start, disable=not _is_main(), unit='step',
             dynamic_ncols=True)
  watch = NonFiniteWatch(train.max_bad_steps)
  stops = StopRequests(train.checkpoint_minutes, train.log_every)
  # tokens/s counts step time only: evaluation and checkpoint saves are timed and left out.
  interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
  in_flight = None
  try:
    with stops:
      for step in range(start + 1, train.steps + 1):
        batch = _global_batch(s, next(batches))
        state, step_metrics = compiled(state, batch)
        # The previous step's verdict is read while this one runs: the check costs no stall.
        if in_flight is not None:
          watch.check(*in_flight)
        in_flight = (step, step_metrics)
        interval_steps += 1
        last = step == train.steps
        evaluating = step % train.eval_every == 0 or last
        if evaluating or step % train.log_every == 0:
          values = jax.device_get(step_metrics)   # waits for the step: the interval is honest
          watch.count(step, values)
          elapsed = time.perf_counter() - interval_start - paused
          row = {k: float(v) for k, v in values.items()}
          row['tokens_per_sec'] = interval_steps * batches.tokens_per_batch / elapsed
          row['learning_rate'] = float(learning_rate(step - 1))
          row['skipped_steps'] = watch.skipped
          bar.set_postfix_str(f'loss {row["loss"]:.4f}, {row["tokens_per_sec"]:,.0f} tokens/s')
          interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
          if evaluating:
            last_eval = run_eval(step)
            row.update(last_eval)
          if last and peak_device_memory() is not None:
            row['peak_device_bytes'] = peak_device_memory()
          metrics.write(step, row)
          watch.stop_if_too_many()
        bar.update(1)
        stopping = stops.stop_now(step)
        if step % train.checkpoint_every == 0 or last or stopping or stops.save_now(step):
          save_start = time.perf_counter()
          watch.check(*in_flight)
          save(step)
          paused += time.perf_counter() - save_start
        if stopping:
          checkpoints.wait()
          if _is_main():
            tqdm.write(f'preempted   {stops.signal_name} at step {step}: saved a checkpoint at '
                       f'step {step} in {checkpoints.directory}; the same command resumes from it')
          return last_eval
        if evaluating:   # the evaluation (and any save) just done stays out of the next interval
          interval_start, paused = time.perf_counter(), 0.0
      watch.check(*in_flight)
  except NonFiniteError as e:
    checkpoints.wait()
    newest = checkpoints.latest_step()
    raise NonFiniteError(f'{e}; ' + ('no checkpoint was written' if newest is None else
                         f'the newest checkpoint, step {newest}, is where a rerun resumes')) from None
  finally:
    bar.close()
    checkpoints.wait()
    checkpoints.close()
    metrics.close()
  peak = peak_device_memory()
  if peak is not None and _is_main():   # GPUs report it; beside the compiled and estimated figures
    _write_json(os.path.join(workdir, 'memory.json'), {**memory, 'peak_device_bytes': peak})
  _print_sample(s, state, tokenizer)
  return last_eval


class NonFiniteWatch:
  """Counts the steps whose update was skipped for a non-finite loss or gradient; raises
  NonFiniteError after `max_bad_steps` in a row. Each step is judged once, whenever its metrics
  are first read."""

  def __init__(self, max_bad_steps: int):
    self.max_bad_steps = max_bad_steps
    self.skipped = 0
    self._in_a_row = 0
    self._judged = 0

  def check(self, step: int, metrics: dict) -> None:
    self.count(step, metrics)
    self.stop_if_too_many()

  def count(self, step: int, metrics: dict) -> None:
    if step <= self._judged:
      return
    self._judged = step
    if not bool(metrics['nonfinite']):
      self._in_a_row = 0
      return
    self.skipped += 1
    self._in_a_row += 1
    if _is_main():
      tqdm.write(f'skipped     step {step}: loss {float(metrics["loss"]):.4g}, gradient norm '
                 f'{float(metrics["grad_norm"]):.4g}; the update was not applied '
                 f'({self._in_a_row} in a row, train.max_bad_steps={self.max_bad_steps})')

  def stop_if_too_many(self) -> None:
    if self._in_a_row >= self.max_bad_steps:
      step = self._judged
      raise NonFiniteError(
          f'step {step}: the loss or gradients were not finite for {self._in_a_row} steps in a row '
          f'(train.max_bad_steps={self.max_bad_steps}); every such update was skipped, so the '
          f'state is still that of step {step - self._in_a_row}. Lower train.learning_rate, raise '
          f'train.warmup_steps or check the data')


def _open_checkpoints(config, workdir: str) -> Checkpointer | None:
  """The workdir's checkpoints, or None when it has none (nothing is created)."""
  directory = os.path.join(workdir, 'checkpoints')
  if not os.path.isdir(directory):
    return None
  return Checkpointer(directory, keep=config.train.keep_checkpoints)


def _stored_block_axes(checkpoints: Checkpointer | None) -> dict | None:
  """The 8-bit moments' blocking recorded in the newest checkpoint whose description reads."""
  for step in checkpoints.steps() if checkpoints else ():
    try:
      meta = checkpoints.read_meta(step)
    except Exception:   # a broken checkpoint: restore reports it and falls back past it
      continue
    return (meta or {}).get('adam_block_axes')
  return None


def _check_checkpoints(s: Setup, checkpoints: Checkpointer) -> None:
  """CheckpointError if the newest checkpoint that can be described holds another model, or
  another adapter / frozen-base / optimizer state, than this config builds."""
  for step in checkpoints.steps():
    try:
      checkpoints.check_compatible(step, s.layout.abstract, checkpoint_meta(s))
      return
    except CheckpointError:
      raise
    except Exception:   # unreadable: restore_newest reports it and tries the next
      continue


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
