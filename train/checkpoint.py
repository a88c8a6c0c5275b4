"""Orbax checkpoints of the train state, the data iterator's position, and what the state means.

A checkpoint holds three items: `state` (the arrays), `data` (the iterator's position, JSON) and
`meta` (JSON: the config fields that fix what the arrays mean, such as the model's shape, the
adapters and the frozen base's format, how 8-bit moments are blocked, and under `unpadded` the true
shape of each array its mesh stored padded, parallel/padding.py). Saves are asynchronous
(training goes on while the arrays are written). Restore reads into an abstract target built under
the *current* mesh, so a checkpoint restores onto any layout: an array padded for one mesh is read
cut or zero-padded to another's, once its true shape is known to be the target's.

Before anything is compiled or written, the newest checkpoint's `meta` and stored shapes are
compared with the config's, so a workdir of a different model gives one clear error instead of an
orbax traceback or a silently reinterpreted state. A checkpoint that then proves bad (truncated or
garbage files, files missing, or values other than were saved: a digest of every array and of the
data position, train/digest.py, is written beside each checkpoint in `checkpoints-digests/` and
checked after each restore) is reported in one line and the next older one is tried; the broken
ones are moved aside, never deleted. A failure that is no evidence against the checkpoint (an I/O
error, memory) stops the restore with nothing changed, so that a retry reads it. With several
processes every one tries the same steps, and they agree on each outcome before going on.
"""
import contextlib
import dataclasses
import errno
import gc
import hashlib
import itertools
import json
import logging
import os
import shutil
import sys
import threading
import time

import jax
import orbax.checkpoint as ocp
from flax import traverse_util

from parallel.padding import path_name, true_shapes
from train.digest import as_numbers, digest_arrays, first_mismatch, tree_digests


_BARRIERS = 'checkpoints'   # the prefix of orbax's barrier names (one is met by hand: restore)
_MIN_REPLICA_SLICE_BYTES = 1 << 20   # replicated arrays with smaller slices are written whole


class CheckpointError(ValueError):
  pass


class DigestMismatch(RuntimeError):
  """A checkpoint decoded, but to other values than were saved."""


class RestoreFailed(CheckpointError):
  """A checkpoint could not be read for a reason that is not evidence against it (an I/O error,
  memory): nothing was changed, and a retry may restore it."""


def _write_small_replicated_arrays_whole():
  """orbax writes an array that several devices hold alike by cutting it into a slice per replica
  for each to write, every slice a small program run on its device: 2.7 ms each on 8 CPU devices,
  528 of them (1.4 s) in the two saves of the tiny preset, for arrays of kilobytes. Arrays whose
  slices would be under a MiB are written whole by their first replica instead; larger ones are
  still shared out (on a GPU orbax does not cut them at all, by its default). The stored arrays are
  the same either way."""
  current = ocp.type_handlers.get_type_handler(jax.Array)
  if (type(current) is ocp.type_handlers.ArrayHandler
      and getattr(current, '_min_slice_bytes_for_replica_parallel', 0) is None):
    # orbax's registered handler, with its metadata store kept (orbax names no public way to it).
    ocp.type_handlers.register_type_handler(jax.Array, ocp.type_handlers.ArrayHandler(
        min_slice_bytes_for_replica_parallel=_MIN_REPLICA_SLICE_BYTES,
        array_metadata_store=current._array_metadata_store), override=True)


@dataclasses.dataclass
class Restored:
  step: int
  state: object
  data: dict
  broken: list[tuple[int, str]]   # newer checkpoints that did not restore: (step, why)


class Checkpointer:

  def __init__(self, directory: str, *, keep: int):
    _write_small_replicated_arrays_whole()
    self.directory = os.path.abspath(directory)
    self._keep = keep
    self._digest_writers: list[threading.Thread] = []
    self._manager = self._open()

  def _open(self):
    with _quiet():   # orbax logs each step whose _CHECKPOINT_METADATA is unreadable; restore reports it
      return self._new_manager()

  def _new_manager(self):
    return ocp.CheckpointManager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(), 'data': ocp.JsonCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            max_to_keep=self._keep, create=True, enable_async_checkpointing=True,
            multiprocessing_options=ocp.options.MultiprocessingOptions(
                barrier_sync_key_prefix=_BARRIERS)))

  def steps(self) -> list[int]:
    """Every committed checkpoint's step, newest first."""
    return sorted(self._manager.all_steps(), reverse=True)

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def save(self, step: int, state, data_state: dict, meta: dict) -> None:
    """Save asynchronously; the digests of the state's arrays and of `data_state` are computed on
    the devices meanwhile and written beside the checkpoint (`digest_path`) by a thread, so the
    save waits for neither."""
    # Dispatched; read before the next step's donation reuses the arrays. Of the true arrays, so
    # that another mesh's padding verifies.
    digests = digest_arrays(state, true_shapes(state, meta.get('unpadded')))
    self._manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state),
        meta=ocp.args.JsonSave(meta)))
    writer = threading.Thread(target=self._write_digests, name=f'digests-{step}', daemon=True,
                              args=(step, digests, _json_digest(data_state)))
    writer.start()
    self._digest_writers.append(writer)

  def digest_path(self, step: int) -> str:
    """Where checkpoint `step`'s digests are kept: beside the checkpoints, not inside orbax's
    folder (which is complete, and renamed into place, before the digests are known)."""
    return os.path.join(self.directory + '-digests', f'{step}.json')

  def _write_digests(self, step: int, digests, data_digest: str) -> None:
    if jax.process_index() != 0:   # every process computed them (one program); one writes
      return
    record = {'arrays': as_numbers(digests), 'data': data_digest}
    path = self.digest_path(step)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + '.tmp', 'w', encoding='utf-8') as f:
      json.dump(record, f, sort_keys=True)
    os.replace(path + '.tmp', path)
    # Those of checkpoints orbax has since removed (train.keep_checkpoints) go too.
    for name in os.listdir(os.path.dirname(path)):
      old = name.partition('.')[0]
      if old.isdigit() and int(old) < step and not os.path.isdir(self.path(int(old))):
        os.remove(os.path.join(os.path.dirname(path), name))

  def path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def read_meta(self, step: int) -> dict | None:
    """The checkpoint's `meta` item; None for a checkpoint written before it existed."""
    if not os.path.isdir(os.path.join(self.path(step), 'meta')):
      return None
    with meeting_orbax_barrier(), _quiet():
      return self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']

  def check_compatible(self, step: int, abstract_state, meta: dict) -> None:
    """Raise CheckpointError naming the first field or tensor in which checkpoint `step` differs
    from this config; any other failure to read it propagates (the caller decides what is broken)."""
    stored_meta = self.read_meta(step)
    hint = (f'resume with the config that wrote it ({os.path.dirname(self.directory)}/config.json) '
            f'or use a fresh --workdir')
    if stored_meta is not None:
      stored, wanted = _flat(stored_meta.get('identity', {})), _flat(meta['identity'])
      for key in sorted(set(stored) | set(wanted)):
        if stored.get(key) != wanted.get(key):
          raise CheckpointError(f'{self.path(step)} was written with {key}={stored.get(key)!r}, '
                                f'this config has {key}={wanted.get(key)!r}; {hint}')
    if stored_meta is not None:
      blocked, here = stored_meta.get('adam_blocked_from', {}), meta.get('adam_blocked_from', {})
      held = lambda shape: f'padded to {shape}' if shape else 'unpadded'
      for path in sorted(set(blocked) | set(here)):
        if blocked.get(path) != here.get(path):
          raise CheckpointError(
              f'{self.path(step)} holds 8-bit Adam moments of {path} blocked from its weights '
              f'{held(blocked.get(path))} (parallel/padding.py), which this mesh holds '
              f'{held(here.get(path))}; 8-bit moments move only between meshes that pad alike: '
              f'resume with the fsdp (and stage) sizes that saved them '
              f'({os.path.dirname(self.directory)}/config.json)')
    name = self._different_array(step, abstract_state, meta.get('unpadded'), stored_meta)
    if name is not None:
      have, want = name[1:]
      raise CheckpointError(f'{self.path(step)} holds a different train state: {name[0]} has shape '
                            f'{have} there but {want} in this config; {hint}')

  def _different_array(self, step: int, abstract_state, unpadded: dict | None,
                       stored_meta: dict | None = None):
    """(name, shape there, shape here) of the first array whose true shape (its stored one less
    any padding, by each side's `unpadded`) differs between checkpoint `step` and
    `abstract_state`, or that one side lacks; None if they agree."""
    if stored_meta is None:
      stored_meta = self.read_meta(step) or {}
    with _quiet():   # reads every array's metadata: a broken checkpoint fails here first
      stored = _shapes(self._state_metadata(step), stored_meta.get('unpadded'))
    wanted = _shapes(abstract_state, unpadded)
    for name in sorted(set(stored) | set(wanted)):
      if stored.get(name) != wanted.get(name):
        return name, stored.get(name), wanted.get(name)
    return None

  def _state_metadata(self, step: int):
    """The stored arrays' metadata. orbax answers a read that failed (no file descriptor left, an
    unreadable folder) with no items at all: a `state` folder that is there but was not read is no
    evidence against the checkpoint, and is raised as the I/O error it is."""
    items = self._manager.item_metadata(step)
    if 'state' in items and items['state'] is not None:
      return items['state']
    folder = os.path.join(self.path(step), 'state')
    if os.path.isdir(folder):
      raise OSError(errno.EIO, f'orbax read no metadata from {folder}, which is there')
    raise FileNotFoundError(errno.ENOENT, f'{folder} is missing')

  def restore(self, step: int, abstract_state, unpadded: dict | None = None) -> tuple[object, dict]:
    """(train state placed as `abstract_state`'s shardings say (any mesh), data iterator state).
    `unpadded`: the true shapes of the target's padded arrays (train/state.py:StateLayout). Where
    the checkpoint's mesh padded an array otherwise, it is read cut or zero-padded to the target,
    after checking that their true shapes agree (the padding is zeros either way)."""
    with meeting_orbax_barrier():
      with _quiet():
        stored = _shapes(self._state_metadata(step))
      same = stored == _shapes(abstract_state)
      if not same:
        different = self._different_array(step, abstract_state, unpadded)
        if different is not None:
          raise CheckpointError(f'{self.path(step)}: {different[0]} has shape {different[1]} '
                                f'there but {different[2]} in this config')
      restored = self._manager.restore(step, args=ocp.args.Composite(
          state=ocp.args.StandardRestore(abstract_state, strict=same),
          data=ocp.args.JsonRestore()))
    return restored['state'], restored['data']

  def saved_digests(self, step: int) -> dict | None:
    """The digests written beside checkpoint `step`; None for a checkpoint without them (saved
    before they existed, or killed before they were written); DigestMismatch if they do not read
    as a record of them."""
    try:
      with open(self.digest_path(step), encoding='utf-8') as f:
        record = json.load(f)
    except FileNotFoundError:
      return None
    except ValueError as e:
      raise DigestMismatch(f'its digests ({self.digest_path(step)}) do not read: {e}') from None
    if not (isinstance(record, dict) and isinstance(record.get('arrays'), dict)
            and isinstance(record.get('data'), str)):
      raise DigestMismatch(f'its digests ({self.digest_path(step)}) are not a record of them')
    return record

  def verify(self, step: int, state, data: dict, unpadded: dict | None = None,
             saved: dict | None = None) -> None:
    """DigestMismatch when what was read differs from what was saved (`saved`: the digests, read
    here if not given; a checkpoint without them is taken as it is)."""
    saved = saved or self.saved_digests(step)
    if saved is None:
      return
    changed = first_mismatch(saved['arrays'], tree_digests(state, true_shapes(state, unpadded)))
    if changed is not None:
      raise DigestMismatch(f'{changed} differs from what was saved (its digest does not match)')
    if saved['data'] != _json_digest(data):
      raise DigestMismatch('the data position differs from what was saved (its digest does not '
                           'match)')

  def restore_newest(self, abstract_state, accept_data=lambda data: None,
                     unpadded: dict | None = None) -> Restored:
    """The newest checkpoint that restores. Only evidence that a checkpoint itself is bad
    (`is_broken`) passes over it to an older one; any other failure changes nothing and raises
    (RestoreFailed where a retry may pass: an I/O error, memory; else CheckpointError). With several processes, all try the same steps and agree on
    each outcome before going on (one process's damaged file passes over that step for all).
    `accept_data(data)` may raise to refuse a stream (an error of the config, not a broken
    checkpoint); `unpadded` as `restore` takes it."""
    broken = []
    steps = agreed('restore/steps', self.steps)
    for step in steps:
      state = data = saved = error = None
      try:
        with _quiet():
          state, data = self.restore(step, abstract_state, unpadded)
        saved = self.saved_digests(step)
      except Exception as e:
        error = e
      outcome, why = agree_outcomes(f'restore/{step}', error)
      if outcome == 'ok':   # every process read it: they compute the digests together
        try:
          self.verify(step, state, data, unpadded, saved)
        except DigestMismatch as e:
          outcome, why = 'broken', one_line(e)
      if outcome in ('temporary', 'failed'):
        raise refusal(self.path(step), why, outcome == 'temporary')
      if outcome == 'broken':
        broken.append((step, why))
        if jax.process_index() == 0 and step != steps[-1]:
          print(f'checkpoint  {self.path(step)} does not restore ({why}); trying an older one')
        continue
      accept_data(data)
      return Restored(step, state, data, broken)
    raise CheckpointError(
        f'no checkpoint in {self.directory} restores (' +
        '; '.join(f'step {s}: {why}' for s, why in broken) +
        '); nothing was changed: restore the files, or use a fresh --workdir')

  def set_aside(self, steps: list[int]) -> str:
    """Move broken checkpoints out of the way of new saves (to checkpoints-broken/); returns where."""
    aside = os.path.join(os.path.dirname(self.directory), 'checkpoints-broken')
    if jax.process_index() == 0:
      os.makedirs(aside, exist_ok=True)
      for step in steps:
        target = os.path.join(aside, str(step))
        suffix = 1
        while os.path.exists(target):
          target, suffix = os.path.join(aside, f'{step}.{suffix}'), suffix + 1
        shutil.move(self.path(step), target)
        if os.path.exists(self.digest_path(step)):
          shutil.move(self.digest_path(step), target + '.digests.json')
    if jax.process_count() > 1:
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices('checkpoints set aside')
    self._manager.close()
    self._manager = self._open()
    return aside

  def wait(self) -> None:
    self._manager.wait_until_finished()
    for writer in self._digest_writers:
      writer.join()
    self._digest_writers = []

  def close(self) -> None:
    self.wait()
    self._manager.close()


@contextlib.contextmanager
def meeting_orbax_barrier(prefix: str | None = _BARRIERS):
  """orbax ends every restore at a barrier of all processes (a collective). A process that fails
  before it (its own shards, or a read of its own) never gets there and would leave the others
  waiting for ever: it meets them there, so that all go on to agree on the outcome. `prefix`: that
  of the checkpointer's barrier names."""
  outermost = not getattr(_BARRIER_MET, 'depth', 0)   # a restore inside another meets it once
  _BARRIER_MET.depth = getattr(_BARRIER_MET, 'depth', 0) + 1
  try:
    yield
  except Exception:
    if outermost and jax.process_count() > 1:
      ocp.multihost.sync_global_processes(
          ocp.multihost.unique_barrier_key('Checkpointer:restore', prefix=prefix))
    raise
  finally:
    _BARRIER_MET.depth -= 1


_BARRIER_MET = threading.local()


@contextlib.contextmanager
def _quiet():
  """A broken checkpoint is reported in one line. While one is tried, orbax's error logs are held
  back, and so are the reports of its failed reads: exceptions left in its abandoned coroutines,
  which Python prints as "Exception ignored in" when they are collected. Everything else (a lost
  peer's line, XLA's fatal messages) is printed as ever. After a failure the reads are given a
  moment to end and are collected while the filter is in place."""
  loggers = [logging.getLogger(name) for name in ('absl', 'asyncio')]
  levels = [logger.level for logger in loggers]
  for logger in loggers:
    logger.setLevel(logging.CRITICAL)
  previous_hook = sys.unraisablehook

  def hook(unraisable):
    if not _from_orbax(unraisable.exc_traceback):
      previous_hook(unraisable)

  sys.unraisablehook = hook
  try:
    yield
  except Exception:
    time.sleep(_DRAIN_SECONDS)
    gc.collect()
    raise
  finally:
    sys.unraisablehook = previous_hook
    for logger, level in zip(loggers, levels):
      logger.setLevel(level)


def _from_orbax(traceback) -> bool:
  while traceback is not None:
    if f'{os.sep}orbax{os.sep}' in traceback.tb_frame.f_code.co_filename:
      return True
    traceback = traceback.tb_next
  return False


_DRAIN_SECONDS = 1.0


# tensorstore's codes for stored data that is not what its format says: truncated, garbage, absent.
_DAMAGED = ('DATA_LOSS', 'NOT_FOUND', 'OUT_OF_RANGE', 'FAILED_PRECONDITION', 'INVALID_ARGUMENT')
# Its codes (and XLA's) for a read that may pass when tried again.
_TEMPORARY = ('RESOURCE_EXHAUSTED', 'UNAVAILABLE', 'DEADLINE_EXCEEDED', 'ABORTED', 'CANCELLED')


def _causes(error: BaseException):
  """`error` and what it was raised from (`raise ... from`), outermost first."""
  while error is not None:
    yield error
    error = error.__cause__


def _code(error: BaseException) -> str:
  return str(error).partition(':')[0].strip()


def is_broken(error: BaseException) -> bool:
  """Whether `error`, raised while a checkpoint was read, is evidence that the checkpoint itself is
  bad: a file missing, or one that does not decode (JSON, UTF-8, tensorstore's codes for damaged
  data), orbax's incomplete checkpoint, arrays of other shapes than it describes, or values other
  than were saved. An I/O error, an out-of-memory or anything else is not."""
  for cause in _causes(error):
    if isinstance(cause, (DigestMismatch, CheckpointError, FileNotFoundError, KeyError,
                          json.JSONDecodeError, UnicodeDecodeError)):
      return True
    if type(cause) is ValueError and (_code(cause) in _DAMAGED
                                      or str(cause).startswith('Found incomplete checkpoint')):
      return True
  return False


def is_temporary(error: BaseException) -> bool:
  """Whether `error` (no evidence against the checkpoint) may pass when the read is tried again:
  an operating system's I/O error, memory, or a code for a temporary failure."""
  for cause in _causes(error):
    if isinstance(cause, MemoryError) or (isinstance(cause, OSError)
                                          and not isinstance(cause, FileNotFoundError)):
      return True
    if _code(cause) in _TEMPORARY:
      return True
  return False


def refusal(path: str, why: str, temporary: bool) -> CheckpointError:
  """The error for a checkpoint that could not be read for a reason that is no evidence against
  it: RestoreFailed (exit 75: start again) when a retry may pass, else a plain CheckpointError."""
  text = (f'{path} could not be read ({why}); that is no evidence the checkpoint is bad, so '
          f'nothing was changed')
  return RestoreFailed(f'{text}: run the same command again to retry') if temporary \
      else CheckpointError(text)


_AGREEMENTS = itertools.count()   # every process agrees on the same things in the same order
_AGREE_TIMEOUT_MS = 3600 * 1000   # a lost process is found by parallel/peers.py long before


def agreed(name: str, decide):
  """`decide()` on process 0, the same value (JSON) on every process."""
  if jax.process_count() == 1:
    return decide()
  from parallel.peers import coordination_client
  key = f'checkpoint/{next(_AGREEMENTS)}/{name}'
  if jax.process_index() == 0:
    coordination_client().key_value_set(key, json.dumps(decide()))
  return json.loads(_wait_for(key))


def _wait_for(key: str) -> str:
  from parallel.peers import coordination_client
  try:
    return coordination_client().blocking_key_value_get(key, _AGREE_TIMEOUT_MS)
  except Exception as e:   # JAX's own error for a timeout
    raise RestoreFailed(f'the processes did not agree on {key} within '
                        f'{_AGREE_TIMEOUT_MS / 1000:.0f} s ({one_line(e)}); nothing was changed: '
                        f'run the same command again') from None


def agree_outcomes(name: str, error: Exception | None) -> tuple[str, str | None]:
  """Every process's outcome of one attempt, agreed: ('ok', None); ('broken', why) when one found
  evidence against the checkpoint; ('temporary' or 'failed', why) when one could not read it for
  another reason (a retry may pass, or not)."""
  kind = ('ok' if error is None else 'broken' if is_broken(error)
          else 'temporary' if is_temporary(error) else 'failed')
  why = None if error is None else one_line(error)
  if jax.process_count() == 1:
    return kind, why
  from parallel.peers import coordination_client
  me = jax.process_index()
  key = f'checkpoint/{next(_AGREEMENTS)}/{name}'
  coordination_client().key_value_set(f'{key}/{me}', json.dumps([kind, why]))
  outcomes = [json.loads(_wait_for(f'{key}/{i}')) for i in range(jax.process_count())]
  for wanted in ('failed', 'temporary', 'broken'):
    for i, (kind, why) in enumerate(outcomes):
      if kind == wanted:
        return wanted, f'process {i}: {why}'
  return 'ok', None


def one_line(error: Exception) -> str:
  while error.__cause__ is not None:   # what orbax wraps: tensorstore's own error, with its code
    error = error.__cause__
  text = str(error).strip().splitlines()
  first = text[0] if text else ''
  return f'{type(error).__name__}: {first[:200]}'


def _json_digest(value) -> str:
  return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def _flat(tree: dict) -> dict:
  return traverse_util.flatten_dict(tree, sep='.') if tree else {}


def _shapes(tree, unpadded: dict | None = None) -> dict[str, tuple]:
  """{name: shape} of each array of `tree`; with `unpadded`, the true shape of those it names."""
  flat = jax.tree_util.tree_flatten_with_path(tree)[0]
  unpadded = unpadded or {}
  names = [path_name(path) for path, _ in flat]
  return {name: tuple(unpadded.get(name, leaf.shape)) for name, (_, leaf) in zip(names, flat)}
