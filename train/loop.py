"""The training loop: from a state at step `start` to `train.steps`, logging, evaluating and
checkpointing as it goes, stopping cleanly (with a checkpoint) when preempted, and refusing to
go on after too many steps whose loss or gradients were not finite.

Between log steps the loop only dispatches: batches arrive from a thread that reads and copies
them ahead (train/feed.py), and nothing is read back from the devices, so the host runs ahead of
the devices and never waits for a step. Each step's metrics stay on the device until the next log
step, evaluation or save, which reads them all at once (a step skipped for a non-finite loss is
reported then). Each step is marked for the profiler (bench/profile.py)."""
import dataclasses
import os
import time

import jax
from tqdm import tqdm

from configs.hardware import peak_flops
from memory.compiled import peak_device_memory
from optim.adamw import learning_rate_schedule
from precision.loss_scale import all_finite
from train.feed import BatchFeed
from train.metrics import MetricsWriter, read_rows
from train.preemption import StopRequests
from train.progress import Progress
from train.setup import Setup


def is_main() -> bool:
  return jax.process_index() == 0


class NonFiniteError(RuntimeError):
  """The loss or gradients stayed non-finite for train.max_bad_steps steps in a row."""


@dataclasses.dataclass
class LoopEnd:
  state: dict
  last_eval: dict      # the last evaluation's figures
  preempted: bool      # stopped by a signal, after saving


def train_loop(s: Setup, compiled, state: dict, start: int, batches, global_batch, checkpoints,
               meta: dict, evaluator, workdir: str, stops: StopRequests) -> LoopEnd:
  """Runs steps start + 1 .. train.steps of the compiled step `compiled`.
  `global_batch` turns a process's rows into the global batch; `evaluator(state, step)` returns
  the validation figures; `meta` goes into every checkpoint beside the state; `stops`: the
  installed signal handlers and wall-clock saves (train/preemption.py)."""
  train = s.config.train
  # Rows of the steps this run trains (again) are cut from the files first: a resume logs each
  # step once. A fresh start evaluates step 0 again, so it keeps none. A finished run whose final
  # evaluation was not recorded writes that step's row again, whole, with the evaluation.
  finishing = 0 < start == train.steps
  logged = ([row for row in read_rows(os.path.join(workdir, 'metrics.jsonl'))
             if row.get('step') == start] if finishing else [])
  metrics = MetricsWriter(workdir, enabled=is_main(), keep_before=start + 1 if start else 0)
  learning_rate = learning_rate_schedule(train)
  with s.context():
    params_finite = jax.jit(all_finite)
  last_eval: dict = {}

  def save(step: int) -> None:
    # Never a non-finite state (the step skips bad updates, so this is only a last guard).
    if not bool(params_finite(state['params'])):
      raise NonFiniteError(f'step {step}: the parameters hold an inf or nan, so they were not saved')
    checkpoints.save(step, state, feed.get_state(), meta)
    stops.saved()

  progress = Progress(train, start, is_main(),
                      s.model.flops_per_token(train.seq_len, base_trains=not s.config.lora.rank),
                      peak_flops(jax.devices()))
  watch = NonFiniteWatch(train.max_bad_steps)
  # tokens/s counts step time only: evaluation and checkpoint saves are timed and left out.
  interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
  feed = None
  try:
    if start == 0 or start == train.steps:
      # Step 0: the untrained model's score, the baseline every later evaluation beats. At
      # train.steps: a finished run whose final evaluation was not recorded.
      eval_start = time.perf_counter()
      last_eval = evaluator(state, start)
      progress.evaluated(time.perf_counter() - eval_start)
      if logged:
        metrics.rewrite(start, {**logged[-1], **last_eval})
      else:
        metrics.write(start, last_eval)
      if start == 0 and stops.stop_now(0):
        if is_main():
          tqdm.write(f'preempted   {stops.signal_name} during the step-0 evaluation: nothing was '
                     f'trained and nothing saved; the same command starts the run again')
        return LoopEnd(state, last_eval, preempted=True)
      interval_start = time.perf_counter()
    feed = BatchFeed(batches, global_batch) if start < train.steps else None
    for step in range(start + 1, train.steps + 1):
      # Nothing is read back while a step is dispatched: a read here would make the host wait
      # for the devices every step (an error, not a slowdown, so that none creeps in).
      with jax.transfer_guard_device_to_host('disallow'):
        with jax.profiler.StepTraceAnnotation('train', step_num=step):
          state, step_metrics = compiled(state, feed.next())
        watch.add(step, step_metrics)
      interval_steps += 1
      last = step == train.steps
      evaluating = step % train.eval_every == 0 or last
      if evaluating or step % train.log_every == 0:
        values = jax.device_get(step_metrics)   # waits for the step: the interval is honest
        watch.judge()   # the row below is written before a run of bad steps stops the run
        elapsed = time.perf_counter() - interval_start - paused
        row = {k: float(v) for k, v in values.items()}
        row['tokens_per_sec'] = interval_steps * batches.tokens_per_batch / elapsed
        row['learning_rate'] = float(learning_rate(step - 1))
        row['skipped_steps'] = watch.skipped
        progress.log(step, row, interval_steps, elapsed)
        interval_start, interval_steps, paused = time.perf_counter(), 0, 0.0
        if evaluating:
          eval_start = time.perf_counter()
          last_eval = evaluator(state, step)
          progress.evaluated(time.perf_counter() - eval_start)
          row.update(last_eval)
        if last and peak_device_memory() is not None:
          row['peak_device_bytes'] = peak_device_memory()
        metrics.write(step, row)
        watch.stop_if_too_many()
      progress.step()
      stopping = stops.stop_now(step)
      if step % train.checkpoint_every == 0 or last or stopping or stops.save_now(step):
        save_start = time.perf_counter()
        watch.judge()
        watch.stop_if_too_many()
        save(step)
        paused += time.perf_counter() - save_start
        progress.saved(time.perf_counter() - save_start)
      if stopping:
        checkpoints.wait()
        if is_main():
          tqdm.write(f'preempted   {stops.signal_name} at step {step}: saved a checkpoint at '
                     f'step {step} in {checkpoints.directory}; the same command resumes from it')
        return LoopEnd(state, last_eval, preempted=True)
      if evaluating:   # the evaluation (and any save) just done stays out of the next interval
        interval_start, paused = time.perf_counter(), 0.0
    watch.judge()
    watch.stop_if_too_many()
  except NonFiniteError as e:
    checkpoints.wait()
    newest = checkpoints.latest_step()
    raise NonFiniteError(f'{e}; ' + ('no checkpoint was written' if newest is None else
                         f'the newest checkpoint, step {newest}, is where a rerun resumes')) from None
  finally:
    if feed is not None:
      feed.close()
    progress.close()
    checkpoints.wait()
    checkpoints.close()
    metrics.close()
  return LoopEnd(state, last_eval, preempted=False)


class NonFiniteWatch:
  """Counts the steps whose update was skipped for a non-finite loss or gradient; raises
  NonFiniteError after `max_bad_steps` in a row. Steps are added as they are dispatched, with
  their metrics still on the device, and judged together by `judge()` (at log steps, evaluations
  and saves: where the loop reads from the devices anyway); `stop_if_too_many()` then raises.
  Bad steps are skipped on the device, so judging late never lets a non-finite value into the
  state; a run of bad steps that reaches max_bad_steps stops at the next judgement, naming the
  step where it did. (optax.apply_if_finite's counters, in the optimizer state, were considered:
  they say how many but not which steps, and the skip they count does not fit: train/step.py.)"""

  def __init__(self, max_bad_steps: int):
    self.max_bad_steps = max_bad_steps
    self.skipped = 0
    self._in_a_row = 0
    self._pending = []   # (step, metrics on the device), not yet judged
    self._judged = 0     # the last step judged

  def add(self, step: int, metrics: dict) -> None:
    self._pending.append((step, metrics))

  def judge(self) -> None:
    """Reads the pending steps' verdicts (one transfer), up to the first step that makes
    max_bad_steps in a row; `stop_if_too_many` then raises."""
    pending, self._pending = self._pending, []
    verdicts = jax.device_get([metrics for _, metrics in pending])
    for (step, _), values in zip(pending, verdicts):
      if self._in_a_row >= self.max_bad_steps:
        return
      self._count(step, values)

  def stop_if_too_many(self) -> None:
    if self._in_a_row >= self.max_bad_steps:
      step = self._judged
      raise NonFiniteError(
          f'step {step}: the loss or gradients were not finite for {self._in_a_row} steps in a row '
          f'(train.max_bad_steps={self.max_bad_steps}); every such update was skipped, so the '
          f'state is still that of step {step - self._in_a_row}. Lower train.learning_rate, raise '
          f'train.warmup_steps or check the data')

  def _count(self, step: int, metrics: dict) -> None:
    self._judged = step
    if not bool(metrics['nonfinite']):
      self._in_a_row = 0
      return
    self.skipped += 1
    self._in_a_row += 1
    if is_main():
      tqdm.write(f'skipped     step {step}: loss {float(metrics["loss"]):.4g}, gradient norm '
                 f'{float(metrics["grad_norm"]):.4g}; the update was not applied '
                 f'({self._in_a_row} in a row, train.max_bad_steps={self.max_bad_steps})')
