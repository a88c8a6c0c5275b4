"""train/loop.py: between log steps the loop reads nothing back from the devices, so the host
dispatches ahead of them; the reads happen at log steps, evaluations and saves."""
import jax
import pytest

from tests.helpers import tiny_config
from tests.test_run import read_metrics, small_corpus
from train import loop, run


def _config(tmp_path):
  return tiny_config(**{'train.steps': 6, 'train.log_every': 3, 'train.eval_every': 6,
                        'train.checkpoint_every': 6, 'data.path': small_corpus(tmp_path)})


def _record_reads(monkeypatch, steps_dispatched):
  """Every read of a device array's value (float, bool, device_get, np.asarray, item) appends the
  number of steps dispatched so far. On a GPU the loop's transfer guard refuses such reads between
  log steps; on the CPU JAX does not count them as transfers, so they are counted here."""
  from jax._src import array
  reads = []
  value, as_numpy, item = array.ArrayImpl._value, array.ArrayImpl.__array__, array.ArrayImpl.item

  def noted(read):
    def wrapper(self, *args, **kwargs):
      reads.append(steps_dispatched[0])
      return read(self, *args, **kwargs)
    return wrapper

  monkeypatch.setattr(array.ArrayImpl, '_value', property(noted(value.fget)))
  monkeypatch.setattr(array.ArrayImpl, '__array__', noted(as_numpy))
  monkeypatch.setattr(array.ArrayImpl, 'item', noted(item))
  return reads


def _counting_steps(monkeypatch):
  """Wraps the compiled train step so that it counts the steps dispatched."""
  dispatched = [0]
  compile_step = run.compile_train_step

  def compile_counting(s):
    compiled = compile_step(s)

    class Counting:
      def __call__(self, state, batch):
        dispatched[0] += 1
        return compiled(state, batch)

      def __getattr__(self, name):   # memory_analysis, as_text, ...: the compiled step's own
        return getattr(compiled, name)
    return Counting()

  monkeypatch.setattr(run, 'compile_train_step', compile_counting)
  return dispatched


def test_steps_between_log_steps_read_nothing_back(tmp_path, monkeypatch):
  """Six steps, logged at 3 and 6 (evaluated and saved at 6): every read of a device value happens
  before the first step, or right after step 3 or step 6 was dispatched, never after 1, 2, 4, 5."""
  config = _config(tmp_path)
  dispatched = _counting_steps(monkeypatch)
  reads = _record_reads(monkeypatch, dispatched)
  run.train_and_evaluate(config, str(tmp_path / 'run'))
  assert dispatched[0] == 6
  assert [row['step'] for row in read_metrics(tmp_path / 'run') if 'loss' in row] == [3, 6]
  assert reads and set(reads) <= {0, 3, 6}, sorted(set(reads))


def test_a_read_between_log_steps_is_seen(tmp_path, monkeypatch):
  """The count above can fail: the watch reading each step's loss (as the loop once read each
  step's verdict) is caught."""
  add = loop.NonFiniteWatch.add

  def reading_add(self, step, metrics):
    float(metrics['loss'])
    add(self, step, metrics)

  monkeypatch.setattr(loop.NonFiniteWatch, 'add', reading_add)
  dispatched = _counting_steps(monkeypatch)
  reads = _record_reads(monkeypatch, dispatched)
  try:
    run.train_and_evaluate(_config(tmp_path), str(tmp_path / 'run'))
  except RuntimeError as e:   # on a GPU the loop's transfer guard refuses the read itself
    assert 'transfer' in str(e)
    return
  assert {1, 2, 4, 5} <= set(reads)


def test_the_watch_reads_pending_steps_at_once():
  """The non-finite verdicts of the steps since the last judgement are read together, in step
  order, and the run stops at the step that makes max_bad_steps in a row."""
  watch = loop.NonFiniteWatch(max_bad_steps=2)
  bad = {'nonfinite': jax.numpy.bool_(True), 'loss': jax.numpy.float32(float('nan')),
         'grad_norm': jax.numpy.float32(float('nan'))}
  good = {**bad, 'nonfinite': jax.numpy.bool_(False)}
  for step, metrics in enumerate([bad, good, bad, bad, bad], start=1):
    watch.add(step, metrics)
  watch.judge()
  with pytest.raises(loop.NonFiniteError, match=r'^step 4: .* 2 steps in a row .* that of step 2'):
    watch.stop_if_too_many()
  assert watch.skipped == 3
