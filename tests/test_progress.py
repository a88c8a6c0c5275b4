"""The loop's progress report (train/progress.py): one plain line per log step when the output is
not a terminal, and an ETA that counts evaluations and saves apart from the steps."""
import types

from tests.helpers import tiny_config
from train import run
from train.progress import Progress, due, duration

TRAIN = types.SimpleNamespace(steps=100, eval_every=50, checkpoint_every=30)


def test_the_eta_adds_the_evaluations_and_saves_still_due():
  assert [due(10, 100, 50), due(50, 100, 50), due(0, 100, 30), due(90, 100, 30)] == [2, 1, 4, 1]
  progress = Progress(TRAIN, 0, enabled=False, flops_per_token=1.0, peak_flops=None,
                      terminal=False)
  assert progress.eta(10) is None   # no step timed yet
  progress.log(10, {'loss': 1.0, 'tokens_per_sec': 1.0}, interval_steps=10, interval_seconds=5.0)
  progress.evaluated(7.0)
  progress.saved(2.0)
  # 90 steps at 0.5 s, evaluations at 50 and 100, saves at 30, 60, 90 and 100.
  assert progress.eta(10) == 90 * 0.5 + 2 * 7.0 + 4 * 2.0
  assert duration(59) == '59 s' and duration(192) == '3 min 12 s' and duration(7260) == '2 h 1 min'


def test_a_run_whose_output_is_not_a_terminal_logs_one_line_per_log_step(tmp_path, capsys):
  run.train_and_evaluate(tiny_config(**{'train.steps': 6, 'train.log_every': 2,
                                      'train.eval_every': 6}), str(tmp_path))
  lines = [l for l in capsys.readouterr().out.splitlines() if l.startswith('step ')]
  assert [l.split(':')[0] for l in lines] == ['step 2/6 (33 %)', 'step 4/6 (66 %)',
                                              'step 6/6 (100 %)']
  assert all('tokens/s' in l and 'loss ' in l for l in lines) and 'ETA' in lines[0]
