"""The training batches, on their way to the devices ahead of the steps that use them.

A thread reads the next `depth` batches from the data stream (a grain lookup and the rows' gather,
data/pipeline.py) and turns each into global device arrays (`global_batch`: the host-to-device
copies), while the devices run the current step; the loop takes them in order. The stream's
checkpointed position stays that of the batches the loop has taken, not of those read ahead, so a
checkpoint resumes at the step after the one it holds.
"""
import concurrent.futures
import collections

import jax


class BatchFeed:
  """`next()` -> the next global batch (device arrays); `get_state()` -> the stream's position after
  the batches taken so far (what a checkpoint records)."""

  def __init__(self, batches, global_batch, depth: int = 2):
    self._batches = batches
    self._global_batch = global_batch
    self._taken = batches.get_state()['step']   # the stream's step of the next batch to take
    self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix='batch-feed')
    self._ahead = collections.deque(self._pool.submit(self._read) for _ in range(depth))

  def _read(self) -> dict:
    with jax.profiler.TraceAnnotation('data: read and copy to device'):
      return self._global_batch(next(self._batches))

  def next(self) -> dict:
    batch = self._ahead.popleft().result()
    self._taken += 1
    self._ahead.append(self._pool.submit(self._read))
    return batch

  def get_state(self) -> dict:
    return {**self._batches.get_state(), 'step': self._taken}

  def close(self) -> None:
    self._pool.shutdown(wait=True, cancel_futures=True)
