"""A training run, top to bottom: check the config, read the data, build the mesh and the state's
layout, compile the step (and record its memory), create or restore the state, train, evaluate,
checkpoint, and print a sample. `--dry_run` stops after the compile."""
import contextlib
import functools
import json
import os
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

import data as data_lib
from data import prepare as data_prepare, source as data_source
from data.mixture import MixtureBatches
from memory.compiled import compiled_memory_spaces, compiler_of, peak_device_memory
from memory.estimate import Frozen, StepShape, estimate, offloaded
from models.config import COMPUTE_FIELDS
from optim.adamw import make_optimizer
from parallel import target as target_lib, xla_flags
from parallel.collectives import collective_stats
from parallel.mesh import data_parallel_size, make_mesh
from parallel.rules import ACTIVATIONS, DATA_PARALLEL_AXES, layout_rules
from parallel.sharding import batch_sharding, process_feed, replicated
from train import checks, compile_cache, init_from, resume
from train.checkpoint import Checkpointer, CheckpointError
from train.validation import EvalSet, Evaluator
from train.loop import is_main, train_loop
from train.donation import HeldBack
from train.offload import OffloadedOptimizer, written_anew
from train.preemption import StopRequests
from train.sample import generate
from train.state import moment_block_axes, state_layout
from train.setup import Setup, pipeline_stack
from train.step import PerDevice, make_train_step
from train.summary import print_summary
from train.workdir_lock import workdir_lock


def setup(config, devices=None, stored_block_axes: dict | None = None) -> Setup:
  """Validate and lay out everything; allocates nothing. `devices`: default all of them.
  `stored_block_axes`: how a checkpoint's 8-bit moments are blocked (they keep that blocking on
  any mesh: re-blocking would change their values)."""
  config, tokenizer_vocab = checks.follow_tokenizer(config)
  spec = checks.model_spec(config, platform=(devices[0] if devices else jax.devices()[0]).platform)
  model, policy = spec.config, spec.policy
  try:
    mesh = make_mesh(dict(config.mesh), devices)
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None
  try:
    feed = process_feed(mesh, ACTIVATIONS)
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None
  checks.check_config(config, data_parallel=data_parallel_size(mesh), process_count=feed[1],
                      tokenizer_vocab=tokenizer_vocab, context=mesh.shape['context'])
  schedule = checks.pipeline_schedule(config, stages=mesh.shape['stage'],
                                      data_parallel=data_parallel_size(mesh))
  platform = mesh.devices.flat[0].platform
  spec = checks.pipelined_attention(config, spec, schedule=schedule, platform=platform)
  model = spec.config
  checks.offload(config, stages=mesh.shape['stage'], device=mesh.devices.flat[0])
  offload = config.parallel.get('offload_optimizer', False)
  rules = layout_rules(config.parallel.zero_stage)
  block_axes = (_block_axes(moment_block_axes(spec, mesh, rules), stored_block_axes)
                if config.quant.adam_bits == 8 else None)
  tx_for_norm = functools.partial(
      make_optimizer, config.train, config.quant.adam_bits, config.quant.adam_block_size,
      amax_histories=policy.matmul.delayed_scaling, block_axes=block_axes,
      master_dtype=policy.master_dtype)
  tx = tx_for_norm()
  try:
    layout = state_layout(spec, tx, mesh, rules, host_optimizer=offload,
                          host_frozen=config.parallel.get('offload_frozen', False))
  except ValueError as e:
    raise checks.ConfigError(str(e)) from None
  # Per-device accumulation (train/step.py) where gradients are replicated over more than one
  # data-parallel device (with one there is nothing to reduce) and summed over several
  # microbatches: the accumulation's, or the pipeline's. Not where that vmap over the data-parallel
  # devices cannot batch the step, and there XLA reduces the gradients where it places them (each
  # microbatch's, as DDP without no_sync): around a zero-bubble pipeline (its shard_map over
  # `stage` is lowered with the wrong local shapes, jax 0.10.2), and around cuDNN's attention on
  # packed rows (`checks.unbatchable_attention`; the flash kernel there would cost more: a 1b step
  # with cuDNN's runs 1.54x as fast as with flash's on an H200). A shard_map over the data-parallel
  # axes instead of the vmap does not compile either: cuDNN's custom partitioning fails inside it
  # (jax 0.10.2).
  repeated = config.train.microbatches > 1 or schedule is not None
  vmappable = ((schedule is None or not schedule.zero_bubble)
               and not checks.unbatchable_attention(config.data.packing, model.attention,
                                                    policy.compute_dtype, platform,
                                                    mesh.shape['context']))
  per_device = (PerDevice(mesh, DATA_PARALLEL_AXES, rules.per_device_activations)
                if rules.grads_replicated and data_parallel_size(mesh) > 1 and repeated
                and vmappable else None)
  dropout = spec.adapters is not None and spec.adapters.dropout > 0
  offloaded_optimizer = None
  if offload:
    offloaded_optimizer = OffloadedOptimizer(
        lambda norm: tx_for_norm(global_norm=norm), layout.stacked, layout.layer_shardings,
        _keyed(layout.update_shardings),
        dict(zip(_keyed(layout.true['params']), layout.update_shapes.leaves, strict=True)),
        on_host=checks.offload_update(config) == 'host')
  step_fn = make_train_step(layout.graphdef, tx, policy, config.train.microbatches,
                            layout=layout, per_device=per_device,
                            dropout_seed=config.train.seed if dropout else None,
                            stack=pipeline_stack(schedule, config, rules),
                            offload=offloaded_optimizer)
  # Only where the new weights are gathered (a ZeRO split) and nothing else is (context
  # parallelism's keys and values keep their combiner).
  options = xla_flags.step_options(
      platform, rules.gathers_new_weights and mesh.shape['fsdp'] > 1 and mesh.shape['context'] == 1)
  tokens_sharding = batch_sharding(mesh, rules.activations)
  # One sharding for every array of the batch (a pytree prefix): inputs, targets, and segments
  # when rows are packed.
  if offload and holds_back(platform):
    held = jax.tree.map(lambda _: False, layout.abstract)
    held['opt_state'] = written_anew(offloaded_optimizer, tx, layout.abstract['opt_state'])
    train_step = HeldBack(step_fn, held, layout.shardings, tokens_sharding, replicated(mesh),
                          compiler_options=options)
  else:
    train_step = jax.jit(step_fn, in_shardings=(layout.shardings, tokens_sharding),
                         out_shardings=(layout.shardings, replicated(mesh)), donate_argnums=0,
                         compiler_options=options)
  return Setup(config, spec, model, policy, mesh, rules, layout, train_step, tokens_sharding,
               None if block_axes is None else _flat_paths(block_axes), schedule, feed)


def holds_back(platform: str) -> bool:
  """Whether the step holds the offloaded optimizer's layer stacks back from donation
  (train/donation.py): off the CPU, whose programs every CPU figure is calibrated on."""
  return platform != 'cpu'


def _keyed(tree) -> dict:
  return {jax.tree_util.keystr(path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _flat_paths(tree) -> dict:
  return {jax.tree_util.keystr(path, simple=True, separator='/'): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def _block_axes(ideal, stored: dict | None):
  """This mesh's ideal blocking (the sharded dimension, train/state.py), or the checkpoint's where
  it has one for every parameter (an older or another model's checkpoint is refused later)."""
  paths = _flat_paths(ideal)
  if stored is None or set(stored) != set(paths):
    return ideal
  if is_main() and any(stored[p] != a for p, a in paths.items()):
    print('note        8-bit Adam moments keep the blocking of the mesh that saved them (re-blocking '
          'would change their values); where this mesh shards them otherwise, the update reshards')
  treedef = jax.tree_util.tree_structure(ideal)
  return jax.tree_util.tree_unflatten(treedef, [stored[p] for p in paths])


def checkpoint_meta(s: Setup) -> dict:
  """What a checkpoint records about its state (train/checkpoint.py): the config fields that fix
  the arrays' meaning, the 8-bit moments' blocking, and the true shapes of padded arrays."""
  model = {k: v for k, v in s.config.model.to_dict().items() if k not in COMPUTE_FIELDS}
  meta = {'identity': {'model': model, 'lora': s.config.lora.to_dict(),
                       'quant': {'weights': s.config.quant.weights}}}
  if s.block_axes is not None:
    meta['adam_block_axes'] = s.block_axes
    # 8-bit moments are blocked from the weights as the optimizer holds them, padded where this
    # mesh pads them: another padding reorders their blocks, so it must be the same to resume.
    true = _flat_paths(s.layout.true['params'])
    padded = {path: list(shape) for (path, leaf), shape in
              zip(true.items(), s.layout.update_shapes.leaves) if tuple(leaf.shape) != shape}
    if padded:
      meta['adam_blocked_from'] = padded
  if s.layout.unpadded:
    meta['unpadded'] = s.layout.unpadded
  return meta


def lower_train_step(s: Setup):
  """The train step lowered on abstract inputs (nothing is allocated)."""
  train = s.config.train
  batch = jax.ShapeDtypeStruct((train.batch_size, train.seq_len), np.int32, sharding=s.batch_sharding)
  with s.context():
    return s.train_step.lower(s.layout.abstract,
                              {key: batch for key in data_lib.batch_keys(s.config.data.packing)})


def compile_train_step(s: Setup):
  """Lower and compile on abstract inputs: nothing is allocated, the memory can be read."""
  lowered = lower_train_step(s)
  with s.context():
    return lowered.compile()


def compile_and_report(s: Setup) -> tuple[object, dict]:
  """The compiled step and its memory report, with the compile's wall-clock seconds (lowering
  included) and whether JAX's persistent cache served it (None: the cache is off)."""
  with compile_cache.watch() as cache:
    start = time.perf_counter()
    compiled = compile_train_step(s)
    seconds = time.perf_counter() - start
  return compiled, {**memory_report(s, compiled), 'compile_seconds': round(seconds, 3),
                    'compile_cache_hit': cache.hit}


def memory_report(s: Setup, compiled) -> dict:
  trainable, base = s.spec.sizes()
  text = compiled.as_text()
  collectives = collective_stats(text, s.mesh.size)
  device_bytes, host_bytes = compiled_memory_spaces(compiled, text)
  estimate_device, estimate_host = estimated_bytes(s)
  report = {
      'num_params': s.model.num_params,
      'trainable_params': trainable,
      'frozen_bytes': base,
      'mesh': dict(s.mesh.shape),
      'device_kind': s.mesh.devices.flat[0].device_kind,
      # Which compiler's figures per_device_bytes are (XLA:CPU keeps fp32 copies of bf16 matmul
      # operands that XLA:GPU does not: the two differ by tens of percent).
      'compiler': f'{compiler_of(s.platform)} {jax.__version__}',
      'zero_stage': s.config.parallel.zero_stage,
      'per_device_bytes': device_bytes,
      'estimate_bytes': estimate_device,
      # What the same step needs on a GPU by the analytic model of XLA:GPU (memory/estimate.py);
      # the GPU's compiled figure itself is `--dry_run --target`'s.
      'estimate_gpu_bytes': estimated_bytes(s, backend='gpu')[0],
      'collectives_per_step': collectives,
  }
  if s.pipeline is not None:
    report['pipeline'] = {**s.pipeline.report(s.model.num_layers, collectives),
                          'gathered_once': step_shape(s).gathers_once}
  local = len(s.mesh.local_devices)
  if host_bytes['total']:   # state in host memory (parallel.offload_*): per device, and per host
    report['host_bytes'] = {**host_bytes, 'per_host': host_bytes['total'] * local}
  if estimate_host['total']:
    report['estimate_host_bytes'] = {**estimate_host, 'per_host': estimate_host['total'] * local}
  return report


def step_shape(s: Setup, backend: str | None = None) -> StepShape:
  """What the analytic model (memory/estimate.py) needs to know of this setup's step, on
  `backend` (default: the platform of the mesh's devices)."""
  train = s.config.train
  rows = train.batch_size // (data_parallel_size(s.mesh) * train.microbatches)
  return StepShape(rows, train.seq_len, fsdp=s.mesh.shape['fsdp'] * s.mesh.shape['context'],
                   context=s.mesh.shape['context'], tensor=s.mesh.shape['tensor'],
                   data_parallel=data_parallel_size(s.mesh) * s.mesh.shape['context'],
                   zero_stage=s.config.parallel.zero_stage, microbatches=train.microbatches,
                   adam_bits=s.config.quant.adam_bits,
                   adam_block_size=s.config.quant.adam_block_size,
                   backend=backend or s.platform,
                   offload_optimizer=s.config.parallel.get('offload_optimizer', False),
                   update_on_host=checks.offload_update(s.config) == 'host',
                   offload_frozen=s.config.parallel.get('offload_frozen', False),
                   packed=bool(s.config.data.packing),
                   device_memory=target_lib.device_memory(s.mesh.devices.flat[0])
                   if (backend or s.platform) == s.platform else 0,
                   **({} if s.pipeline is None else dict(
                       stages=s.pipeline.stages, pipeline_microbatches=s.pipeline.microbatches,
                       repeats=s.pipeline.repeats, schedule=s.pipeline.name,
                       gather_once=s.config.parallel.get('pipeline_gather_once', False),
                       chunk_layers=s.pipeline.chunk_layers)))


def estimated_bytes(s: Setup, backend: str | None = None) -> tuple[dict, dict]:
  """The analytic model's bytes per device (memory/estimate.py) for this setup's step, on
  `backend` (default: the platform of the mesh's devices): (in device memory, in host memory)."""
  shape = step_shape(s, backend)
  trainable, base = s.spec.sizes()
  frozen = (Frozen(trainable, base, quantized=s.spec.base_format is not None)
            if 'frozen' in s.layout.abstract else None)
  return estimate(s.model, s.policy, shape, frozen), offloaded(s.model, s.policy, shape, frozen)


def _write_json(path: str, value) -> None:
  if is_main():
    with open(path, 'w', encoding='utf-8') as f:
      json.dump(value, f, indent=2, sort_keys=True)
      f.write('\n')


def _open_source(config):
  """The init_from source, with the model shape taken from it (before anything is built)."""
  source = init_from.open_source(config)
  if source is not None:
    init_from.apply_model_fields(config, source)
  return source


def dry_run(config, workdir: str, devices=None, target: str | None = None) -> dict:
  """Compile the step (and creating the state) and write memory.json; nothing runs. `devices`
  (default: this process's): compile-only devices of `target` (`--target`, parallel/target.py)."""
  source = _open_source(config)
  checkpoints = _open_checkpoints(config, workdir)
  s = setup(config, devices, stored_block_axes=_stored_block_axes(checkpoints))
  if source is not None:
    init_from.check_source(s, source)
  # A bad glob, directory or tokenizer fails now, not when the real run starts.
  data_source.check_data(config.data)
  with workdir_lock(workdir, enabled=is_main()):
    if checkpoints:   # nor may it overwrite another model's memory.json
      _check_checkpoints(s, checkpoints)
      checkpoints.close()
    _, memory = compile_and_report(s)
    if target is not None:
      memory['target'] = target
    # The state's creation, as a run makes it: its peak may exceed the step's (a whole-stack draw).
    memory['init_bytes'] = init_from.creation_bytes(s, source)
    print_summary(s, memory)
    _write_json(os.path.join(workdir, 'memory.json'), memory)
  return memory


def make_tokenizer(config):
  """`data.tokenizer`, or DataError in one line."""
  return data_prepare.open_tokenizer(config.data.tokenizer)


def open_data(config, workdir: str) -> list[tuple[str, float, data_lib.PreparedData]]:
  """`data.path`'s sources as prepared shards, (name, weight, prepared data) each (one, named '',
  unless it is a mixture): a glob is prepared into the workdir's cache by the main process first
  (the others then read it, or prepare their own where the file system is not shared)."""
  cache = os.path.join(workdir, 'data')
  data = config.data
  if jax.process_count() > 1 and not data_source.is_prepared_path(data.path):
    if is_main():
      data_source.open_sources(data, cache)
    multihost_utils.sync_global_devices('prepared data')
  return data_source.open_sources(data, cache, prepare_here=is_main(), progress=is_main())


@contextlib.contextmanager
def _naming(source: str):
  """A DataError about one source of a mixture names it."""
  try:
    yield
  except data_lib.DataError as e:
    if not source:
      raise
    raise data_lib.DataError(f'data.path source {source!r}: {e}') from None


def train_batches(s: Setup, sources: list) -> data_lib.TokenBatches | MixtureBatches:
  """The training batches of this process's rows: one source's, or a mixture's."""
  config, train = s.config, s.config.train
  windows = []
  for name, weight, prepared in sources:
    with _naming(name):
      windows.append((name, weight, data_lib.Windows(prepared.split('train'), train.seq_len,
                                                     config.data.packing)))
  if len(windows) == 1 and windows[0][0] == '':
    return data_lib.TokenBatches(windows[0][2], global_batch_size=train.batch_size,
                                 seed=train.seed, process_index=s.feed[0],
                                 process_count=s.feed[1])
  return MixtureBatches(windows, global_batch_size=train.batch_size, seed=train.seed,
                        process_index=s.feed[0], process_count=s.feed[1])


def evaluator(s: Setup, sources: list) -> Evaluator:
  """The run's validation: each source's evaluation set (a mixture's scored apart)."""
  sets = []
  for name, weight, prepared in sources:
    with _naming(name):
      sets.append(EvalSet(name, weight, eval_set(s, prepared), prepared.bytes_per_token('val')))
  return Evaluator(s, sets)


def _global_batch(s: Setup, local: dict, sharding=None) -> dict:
  """Each process contributes its own rows; the result is one global array per key."""
  return {k: jax.make_array_from_process_local_data(sharding or s.batch_sharding, v)
          for k, v in local.items()}


def eval_set(s: Setup, prepared: data_lib.PreparedData) -> dict:
  """The validation windows as global [batches, batch_size, seq_len] arrays (train.eval_tokens)."""
  train = s.config.train
  windows = data_lib.Windows(prepared.split('val'), train.seq_len, s.config.data.packing)
  local = data_lib.eval_batches(windows, batch_size=train.batch_size, eval_tokens=train.eval_tokens,
                                process_index=s.feed[0], process_count=s.feed[1])
  return _global_batch(s, local, eval_sharding(s))


def eval_sharding(s: Setup):
  """Evaluation batches stacked on a leading axis, each laid out like a train batch."""
  return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(None, *s.batch_sharding.spec))


def train_and_evaluate(config, workdir: str) -> dict:
  """Train (or resume) in `workdir`; returns the last evaluation. The phases of a run:"""
  # 1. Check everything the run reads (config, init_from source, checkpoints, data) before any
  #    compile or write.
  source = _open_source(config)
  checkpoints = _open_checkpoints(config, workdir)
  s = setup(config, stored_block_axes=_stored_block_axes(checkpoints))
  tokenizer = make_tokenizer(config)
  data_source.check_data(config.data)
  # The stop handlers (SIGTERM, Ctrl-C) are in place from here: a signal during the compile or
  # the first evaluation, minutes on a large model, stops the run cleanly too.
  with (workdir_lock(workdir, enabled=is_main()),
        StopRequests(config.train.checkpoint_minutes, config.train.log_every) as stops):
    train = s.config.train
    resuming = checkpoints is not None and bool(checkpoints.steps())
    if resuming:   # refuse a checkpoint of another model before any compile or write
      described = _check_checkpoints(s, checkpoints)
      newest = checkpoints.steps()[0]
      final = resume.finished_evaluation(workdir, newest, train.steps)
      # A requeued or retried job: every file stays as it is. (Unless the newest checkpoint cannot
      # even be described: then restore reports it and falls back.)
      if final is not None and described == newest:
        checkpoints.close()
        if is_main():
          print(resume.completion_line(workdir, newest, final))
        return final
      continuing = resume.continuation_line(workdir, newest, train.steps)
      if continuing and is_main():
        print(continuing)
    elif source is not None:   # and a source whose tensors disagree with the model
      init_from.check_source(s, source)
    sources = open_data(config, workdir)   # a glob is prepared into the workdir on first use
    batches = train_batches(s, sources)
    scores = evaluator(s, sources)

    # 2. Compile the step: its memory is known before the state is allocated.
    compiled, memory = compile_and_report(s)

    # 3. The state: restored from the newest checkpoint that restores (before anything is
    #    written; none restoring is an error that leaves every file as it was), else imported
    #    from init_from, else fresh.
    restored = (checkpoints.restore_newest(s.layout.abstract, batches.set_state, s.layout.unpadded)
                if resuming else None)
    print_summary(s, memory)
    _write_json(os.path.join(workdir, 'config.json'), s.config.to_dict())
    _write_json(os.path.join(workdir, 'memory.json'), memory)
    if restored is None:
      checkpoints = checkpoints or Checkpointer(os.path.join(workdir, 'checkpoints'),
                                                keep=train.keep_checkpoints)
      if source is None:
        state, start = init_from.fresh_state(s), 0
      else:
        (state, source), start = init_from.state_from(s, source), 0
        if is_main():
          print(f'init        base weights from {source.description}')
    else:
      state, start = restored.state, restored.step
      _report_restored(restored, checkpoints)

    # 4. Train, evaluating and checkpointing as the config says.
    end = train_loop(s, compiled, state, start, batches, lambda rows: _global_batch(s, rows),
                     checkpoints, checkpoint_meta(s), scores, workdir, stops)
    if end.preempted:
      return end.last_eval

    # 5. What the devices reported, and a sample of the trained model.
    peak = peak_device_memory()
    if peak is not None and is_main():   # GPUs report it; beside the compiled and estimated figures
      _write_json(os.path.join(workdir, 'memory.json'), {**memory, 'peak_device_bytes': peak})
    _print_sample(s, end.state, tokenizer)
    return end.last_eval


def _report_restored(restored, checkpoints: Checkpointer) -> None:
  if restored.broken:
    aside = checkpoints.set_aside([step for step, _ in restored.broken])
    if is_main():
      print(f'checkpoint  moved the {len(restored.broken)} that did not restore to {aside}')
  if is_main():
    print(f'resumed     from step {restored.step} in {checkpoints.directory}')


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


def _check_checkpoints(s: Setup, checkpoints: Checkpointer) -> int | None:
  """CheckpointError if the newest checkpoint that can be described holds another model, or
  another adapter / frozen-base / optimizer state, than this config builds; else its step (None:
  none can be described)."""
  for step in checkpoints.steps():
    try:
      checkpoints.check_compatible(step, s.layout.abstract, checkpoint_meta(s))
      return step
    except CheckpointError:
      raise
    except Exception:   # unreadable: restore_newest reports it and tries the next
      continue
  return None


def _print_sample(s: Setup, state, tokenizer) -> None:
  """Every process runs the generation (the parameters span all of them); process 0 prints it."""
  sample = s.config.sample
  # No rules in context: a batch of one cannot be split over the data-parallel devices.
  tokens = generate(s.layout.graphdef, state['params'], tokenizer.encode(sample.prompt),
                    frozen=state.get('frozen'), model_shapes=s.layout.model_shapes,
                    num_tokens=sample.length, window=s.config.train.seq_len,
                    temperature=sample.temperature, seed=s.config.train.seed,
                    vocab_limit=tokenizer.vocab_size)
  if is_main():
    print(f'sample (prompt {sample.prompt!r}, temperature {sample.temperature}):')
    print(tokenizer.decode(tokens))
