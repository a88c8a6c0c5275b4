"""Whole runs: the files a run leaves, exact resume, and bad input refused before anything is written."""
import json
import os
import shutil
import subprocess

import pytest

from data import DataError
from tests.helpers import child_environ, python, tiny_config
from train import checks, run
from train.checkpoint import CheckpointError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def small_corpus(tmp_path) -> str:
  """A few files of real text (this repository's Python), so runs do not read the 31 MB corpus."""
  folder = tmp_path / 'corpus'
  folder.mkdir()
  for name in ('models/layers.py', 'train/run.py', 'train/step.py', 'data/pipeline.py',
               'data/corpus.py', 'models/dense.py', 'memory/estimate.py', 'main.py'):
    shutil.copy(os.path.join(ROOT, name), folder / name.replace('/', '_'))
  return str(folder / '*.py')


def read_metrics(workdir) -> list[dict]:
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def losses_by_step(workdir) -> dict[int, float]:
  return {row['step']: row['loss'] for row in read_metrics(workdir) if 'loss' in row}


def test_resume_reproduces_the_next_losses_of_an_uninterrupted_run(tmp_path):
  config = tiny_config(**{'train.steps': 6, 'train.checkpoint_every': 3, 'train.log_every': 1,
                          'train.eval_every': 6, 'data.path': small_corpus(tmp_path)})
  straight = tmp_path / 'straight'
  run.train_and_evaluate(config, str(straight))
  assert sorted(os.listdir(straight / 'checkpoints')) == ['3', '6']

  # The "crash": a copy of the run as it stood after the step-3 checkpoint.
  resumed = tmp_path / 'resumed'
  shutil.copytree(straight, resumed)
  shutil.rmtree(resumed / 'checkpoints' / '6')
  run.train_and_evaluate(config, str(resumed))

  # metrics.jsonl kept: the rows of steps 4-6 are replaced by the resumed run's, logged once.
  assert [row['step'] for row in read_metrics(resumed) if 'loss' in row] == [1, 2, 3, 4, 5, 6]
  assert losses_by_step(resumed) == losses_by_step(straight)


def modification_times(workdir) -> dict:
  """Every file's mtime but the lock's (which a refused run holds while it checks)."""
  return {p: os.path.getmtime(p) for p in map(str, workdir.rglob('*')) if not p.endswith('.lock')}


LORA = {'lora.rank': 4, 'train.learning_rate': 1e-3}


@pytest.fixture(scope='module')
def two_step_runs(tmp_path_factory):
  """Finished 2-step runs, plain and LoRA, made once; tests resume copies of them."""
  tmp = tmp_path_factory.mktemp('two_step')
  corpus = small_corpus(tmp)
  runs = {}
  for name, first in (('plain', {}), ('lora', LORA)):
    runs[name] = tmp / name
    run.train_and_evaluate(tiny_config(**{'train.steps': 2, 'data.path': corpus, **first}),
                           str(runs[name]))
  return corpus, runs


@pytest.mark.parametrize('first, then, message', [
    ({}, {'model.d_model': 96}, r'was written with model.d_model=64, this config has model.d_model=96'),
    ({}, {'model.rope_theta': 500000.0}, r'model.rope_theta=10000.0, this config has model.rope_theta=500000.0'),
    (LORA, {**LORA, 'lora.rank': 8}, r'lora.rank=4, this config has lora.rank=8'),
    (LORA, {**LORA, 'lora.alpha': 32.0}, r'lora.alpha=16.0, this config has lora.alpha=32.0'),
    (LORA, {**LORA, 'quant.weights': 'nf4'}, r"quant.weights='none', this config has quant.weights='nf4'"),
    ({}, {'quant.adam_bits': 8}, r'holds a different train state: opt_state/.* has shape'),
])
def test_a_checkpoint_of_a_different_model_or_state_is_refused_and_left_untouched(
    tmp_path, first, then, message, two_step_runs):
  corpus, runs = two_step_runs
  workdir = tmp_path / 'w'
  shutil.copytree(runs['lora' if first else 'plain'], workdir)
  before = modification_times(workdir)
  config_before = (workdir / 'config.json').read_text()

  changed = tiny_config(**{'train.steps': 4, 'data.path': corpus, **then})
  with pytest.raises(CheckpointError, match=message):
    run.train_and_evaluate(changed, str(workdir))
  assert modification_times(workdir) == before
  assert (workdir / 'config.json').read_text() == config_before


def test_resuming_with_a_different_data_stream_is_refused_before_any_write(tmp_path):
  corpus = small_corpus(tmp_path)
  workdir = tmp_path / 'w'
  run.train_and_evaluate(tiny_config(**{'train.steps': 2, 'data.path': corpus}), str(workdir))
  before = modification_times(workdir)
  other_seed = tiny_config(**{'train.steps': 4, 'data.path': corpus, 'train.seed': 1})
  with pytest.raises(DataError, match='data iterator state has seed=0 but this run has seed=1'):
    run.train_and_evaluate(other_seed, str(workdir))
  assert modification_times(workdir) == before


@pytest.mark.parametrize('overrides, message', [
    ({'data.path': '/no/such/dir/*.txt'}, "data.path='/no/such/dir/\\*.txt' matches no files"),
    ({'train.batch_size': 12}, 'train.batch_size=12 is not divisible by 8 data-parallel devices'),
    ({'train.seq_len': 512}, 'train.seq_len=512 is above the model maximum model.max_seq_len=256'),
    ({'precision': 'fp12'}, "precision='fp12' is not a known policy"),
    ({'mesh.data': 3}, 'mesh .* has 3 devices but 8 are available'),
    ({'model.num_kv_heads': 0}, 'model.num_kv_heads=0; it must be a positive integer'),
    ({'train.b2': 1.5}, r'train.b2=1.5; it must be a number in \[0, 1\)'),
    ({'train.steps': True}, 'train.steps=True; it must be a positive integer'),
    ({'train.warmup_steps': False}, 'train.warmup_steps=False; it must be an integer >= 0'),
])
def test_bad_input_is_refused_before_anything_is_written(tmp_path, overrides, message):
  workdir = tmp_path / 'w'
  with pytest.raises((checks.ConfigError, DataError), match=message):
    run.train_and_evaluate(tiny_config(**overrides), str(workdir))
  assert not workdir.exists()


def test_bad_prepared_data_is_refused_before_anything_is_written(tmp_path):
  from data.prepare import prepare
  prepared = tmp_path / 'prepared'
  prepare(small_corpus(tmp_path), 'bytes', str(prepared), val_fraction=0.5, progress=False)
  config = lambda **o: tiny_config(**{'data.path': str(prepared), **o})
  workdir = tmp_path / 'w'
  from tokenizers import Tokenizer, models, pre_tokenizers, trainers
  other = Tokenizer(models.BPE())   # 256 byte-level tokens: fits the model, but is not `bytes`
  other.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  other.train_from_iterator(['text'], trainers.BpeTrainer(
      vocab_size=256, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  other.save(str(tmp_path / 'tokenizer.json'))
  with pytest.raises(DataError, match='was prepared with the tokenizer bytes'):
    run.train_and_evaluate(config(**{'data.tokenizer': str(tmp_path / 'tokenizer.json')}),
                           str(workdir))
  with pytest.raises(DataError, match='no window of train.seq_len=256'):
    (tmp_path / 'one').mkdir()
    (tmp_path / 'one' / 'short.txt').write_text('short')
    run.train_and_evaluate(tiny_config(**{'data.path': str(tmp_path / 'one' / '*.txt'),
                                          'train.seq_len': 256}), str(workdir))
  shard = prepared / 'train-00000.bin'
  shard.write_bytes(shard.read_bytes()[::-1])   # the same size, other bytes
  with pytest.raises(DataError, match='does not match the sampled fingerprint'):
    run.train_and_evaluate(config(), str(workdir))
  assert not (workdir / 'config.json').exists() and not (workdir / 'checkpoints').exists()


def main_py(*args, cwd=ROOT):
  env = child_environ()
  return subprocess.run([*python(env), os.path.join(ROOT, 'main.py'), *args], cwd=cwd, env=env,
                        capture_output=True, text=True, timeout=600)


def test_main_writes_config_metrics_memory_and_a_checkpoint(tmp_path):
  workdir = tmp_path / 'W'
  result = main_py('--config=configs/default.py:tiny', f'--workdir={workdir}',
                   '--config.train.steps=30', f'--config.data.path={small_corpus(tmp_path)}')
  assert result.returncode == 0, result.stderr[-3000:]
  assert json.loads((workdir / 'config.json').read_text())['train']['steps'] == 30
  rows = read_metrics(workdir)
  assert 'loss' not in rows[0] and rows[0]['step'] == 0 and 'eval_loss' in rows[0]  # the baseline
  assert all('loss' in row and 'tokens_per_sec' in row for row in rows[1:])
  losses = [row['loss'] for row in rows[1:]]
  assert losses[-1] < losses[0]
  evals = [row['eval_loss'] for row in rows if 'eval_loss' in row]
  assert len(evals) == 3 and evals[-1] < evals[0]   # step 0, then every 30 / 2 = 15 steps
  memory = json.loads((workdir / 'memory.json').read_text())
  assert memory['num_params'] > 0 and memory['mesh']['data'] == 1
  compiled = memory['per_device_bytes']
  assert compiled['total'] == compiled['arguments'] + compiled['outputs'] - compiled['aliased'] + compiled['temp']
  assert set(memory['estimate_bytes']) >= {'params', 'grads', 'optimizer', 'activations', 'total'}
  assert memory['estimate_bytes']['total'] == sum(v for k, v in memory['estimate_bytes'].items() if k != 'total')
  assert (workdir / 'checkpoints' / '30').is_dir()
  assert any(p.name.startswith('events.out.tfevents') for p in (workdir / 'tensorboard').iterdir())
  assert 'sample (prompt' in result.stdout


@pytest.mark.parametrize('args, message', [
    (['--config.train.nope=1'], "unknown config key 'train.nope'; keys of train: "),
    (['--config=configs/missing.py'], 'no such config file'),
    (['--config=configs/default.py:huge'], "model preset 'huge' is not known"),
    (['--host_devices=2', '--config.train.batch_size=5'], 'train.batch_size=5 is not divisible'),
])
def test_main_reports_bad_input_in_one_line(tmp_path, args, message):
  result = main_py('--dry_run', f'--workdir={tmp_path / "w"}', *args)
  assert result.returncode != 0
  assert 'Traceback' not in result.stderr
  assert message in result.stderr.strip().splitlines()[-1]
  assert not (tmp_path / 'w').exists()


def test_host_devices_simulates_a_data_parallel_mesh(tmp_path):
  result = main_py('--config=configs/default.py:tiny', '--host_devices=4', '--dry_run',
                   '--config.model.scan_unroll=2', f'--workdir={tmp_path}')
  assert result.returncode == 0, result.stderr[-3000:]
  memory = json.loads((tmp_path / 'memory.json').read_text())
  assert memory['mesh'] == {'stage': 1, 'data': 4, 'fsdp': 1, 'context': 1, 'tensor': 1}
  # An unrolled scan is said to be outside what the estimate models.
  assert 'model.scan_unroll=2: the estimate models the rolled layer scan' in result.stdout
