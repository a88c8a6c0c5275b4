"""Tests for train/validation.py (the figures and their standard errors) and train/evaluate.py
(`python -m cli.evaluate`)."""
import json
import math

import numpy as np
import pytest

from train.validation import figures


def test_standard_error_of_equal_windows_is_the_textbook_one():
  rng = np.random.default_rng(0)
  means = rng.normal(2.0, 0.3, size=400)          # each window's mean loss
  counts = np.full(400, 128)
  result = figures(means * counts, counts, bytes_per_token=1.0)
  assert result["eval_loss"] == pytest.approx(means.mean(), rel=1e-12)
  assert result["eval_loss_sem"] == pytest.approx(means.std(ddof=1) / math.sqrt(400), rel=1e-12)
  assert result["eval_bits_per_byte"] == pytest.approx(means.mean() / math.log(2), rel=1e-12)
  assert result["eval_tokens"] == 400 * 128 and result["eval_windows"] == 400


def test_unequal_windows_weigh_tokens_and_skip_empty_windows():
  sums, counts = np.array([10.0, 30.0, 0.0, 12.0]), np.array([10, 20, 0, 6])
  result = figures(sums, counts, bytes_per_token=2.0)
  mean = 52.0 / 36
  assert result["eval_loss"] == pytest.approx(mean, rel=1e-12)
  residuals = sums[[0, 1, 3]] - mean * counts[[0, 1, 3]]
  expected = math.sqrt((residuals ** 2).sum() / (3 * 2)) / (36 / 3)
  assert result["eval_loss_sem"] == pytest.approx(expected, rel=1e-12)
  assert result["eval_bits_per_byte"] == pytest.approx(mean / math.log(2) / 2, rel=1e-12)
  assert result["eval_windows"] == 3


def test_standard_error_covers_the_true_mean_as_often_as_it_should():
  # 2000 evaluation sets of 50 windows with a known mean: |error| < 1.96 SEM in ~95 % of them.
  rng = np.random.default_rng(1)
  inside = 0
  for _ in range(2000):
    counts = rng.integers(20, 200, size=50)
    sums = rng.normal(1.5, 0.4, size=50) * counts
    result = figures(sums, counts, 1.0)
    inside += abs(result["eval_loss"] - 1.5) < 1.96 * result["eval_loss_sem"]
  # Binomial(2000, 0.95): its standard deviation is 0.49 %; 3 of them either side, plus the
  # t-distribution's wider tails at 49 degrees of freedom (1.96 covers 94.4 % there).
  assert 0.93 < inside / 2000 < 0.965


def test_evaluate_scores_a_runs_checkpoint_as_the_run_did_and_on_other_data(tmp_path):
  from data import DataError
  from data.prepare import prepare
  from tests.helpers import tiny_config
  from train import run
  from train.evaluate import evaluate_workdir
  corpus = tmp_path / "corpus"
  corpus.mkdir()
  for i in range(24):
    (corpus / f"f{i:02d}.txt").write_text(f"line {i} of a small corpus\n" * (40 + 7 * i))
  config = tiny_config(**{"train.steps": 2, "data.path": str(corpus / "*.txt")})
  final = run.train_and_evaluate(config, str(tmp_path / "run"))
  again = evaluate_workdir(str(tmp_path / "run"))
  assert again["step"] == 2
  for key in ("eval_loss", "eval_loss_sem", "eval_tokens"):
    assert again[key] == pytest.approx(final[key], rel=1e-6)
  # Another prepared set: other documents, other figures, recorded beside the run's.
  prepare(str(corpus / "f1*.txt"), "bytes", str(tmp_path / "other"), val_fraction=0.5,
          progress=False)
  other = evaluate_workdir(str(tmp_path / "run"), str(tmp_path / "other"), eval_tokens=256)
  assert other["eval_tokens"] <= 8 * 64 and other["eval_loss"] != pytest.approx(again["eval_loss"])
  rows = [json.loads(line) for line in open(tmp_path / "run" / "evaluations.jsonl")]
  assert [r["step"] for r in rows] == [2, 2] and rows[1]["data"] == str(tmp_path / "other")
  with pytest.raises(DataError, match="holds no checkpoint"):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text((tmp_path / "run" / "config.json").read_text())
    evaluate_workdir(str(tmp_path / "empty"))
