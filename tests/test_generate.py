"""`python -m cli.generate` (and its old name, `train.generate`): samples from a trained run's checkpoint; greedy output is the argmax of
a full forward pass without the cache; the same seed repeats; top-k and top-p truncate as defined;
a missing run, a missing checkpoint and a prompt longer than the context are refused in one line."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from cli.generate import main
from tests.helpers import python, reordered_rtol, tiny_config
from train import ptq, run
from train.generate import generate_text
from train.sample import truncated


def _trained(tmp_path_factory, name: str, **overrides):
  workdir = tmp_path_factory.mktemp(name)
  run.train_and_evaluate(tiny_config(**{'train.checkpoint_every': 2, **overrides}), str(workdir))
  return workdir


@pytest.fixture(scope='module')
def plain(tmp_path_factory):
  return _trained(tmp_path_factory, 'plain', **{'train.steps': 4})


@pytest.fixture(scope='module')
def lora(tmp_path_factory):
  return _trained(tmp_path_factory, 'lora', **{'train.steps': 2, 'lora.rank': 4})


def test_greedy_output_is_the_argmax_of_a_full_forward_pass(plain):
  workdir = str(plain)
  result = generate_text(workdir, ['def ', 'import os\n'], max_tokens=24, temperature=0.0)
  assert result['step'] == 4 and result['new_tokens'] == 48
  config = ptq.run_config(workdir, tiny_config())
  params, _, s = ptq.restore_weights(workdir, config, with_setup=True)
  model = nnx.merge(s.layout.graphdef, params)
  tokenizer = run.make_tokenizer(config)
  full = jax.jit(lambda tokens: model(tokens))
  for prompt, [text] in zip(['def ', 'import os\n'], result['texts']):
    ids = tokenizer.encode(text)
    assert text.startswith(prompt) and len(ids) == len(tokenizer.encode(prompt)) + 24
    for i in range(len(tokenizer.encode(prompt)), len(ids)):
      padded = np.zeros((1, 64), np.int32)   # one shape, one compile: the causal mask hides the rest
      padded[0, :i] = ids[:i]
      logits = full(jnp.asarray(padded))[0, i - 1]
      top = float(jnp.max(logits))   # within the cached pass's reordered-sum rounding of the argmax
      assert top - float(logits[ids[i]]) <= reordered_rtol(64 * 64) * abs(top) + 1e-30


def test_a_lora_run_samples_and_repeats_with_its_seed(lora, capsys):
  kwargs = dict(max_tokens=16, temperature=1.0, top_k=20, top_p=0.9, rows=2)
  first = generate_text(str(lora), ['def '], seed=1, **kwargs)
  assert first['texts'] == generate_text(str(lora), ['def '], seed=1, **kwargs)['texts']
  assert first['texts'] != generate_text(str(lora), ['def '], seed=2, **kwargs)['texts']
  assert main([f'--workdir={lora}', '--prompt=def ', '--max_tokens=8', '--seed=0',
               '--step=2']) == 0
  printed = capsys.readouterr().out
  assert printed.count('--- prompt "def ", sample 1 of 1:') == 1
  assert 'new tokens from step 2' in printed and 'tokens/s' in printed


def test_top_k_and_top_p_keep_the_tokens_they_name():
  logits = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]]))
  kept = lambda k, p: np.isfinite(np.asarray(truncated(logits, k, p)))[0].tolist()
  assert kept(2, 1.0) == [True, True, False, False]
  assert kept(0, 0.75) == [True, True, False, False]   # 0.5 < 0.75; 0.5 + 0.3 reaches it
  assert kept(0, 0.5) == [True, False, False, False]
  assert kept(0, 1.0) == [True] * 4 and kept(3, 0.99) == [True, True, True, False]


def test_a_missing_run_checkpoint_or_room_is_refused_in_one_line(plain, tmp_path, capsys):
  (tmp_path / 'empty' / 'checkpoints').mkdir(parents=True)
  (tmp_path / 'empty' / 'config.json').write_text('{}')
  cases = [([f'--workdir={tmp_path}/none', '--prompt=x'], 'holds no run'),
           ([f'--workdir={tmp_path}/empty', '--prompt=x'], 'holds no checkpoint'),
           ([f'--workdir={plain}', '--prompt=x', '--step=7'], 'checkpoints at steps 2, 4'),
           ([f'--workdir={plain}', '--prompt=' + 'x' * 300], 'does not fit the model'),
           ([f'--workdir={plain}', '--prompt='], 'is empty')]
  for argv, why in cases:
    assert main(argv) == 2
    error = capsys.readouterr().err
    assert why in error and error.count('\n') == 1, error


def test_the_old_command_names_still_run_the_programs(tmp_path):
  """`python -m train.generate` (and evaluate, export_hf) moved to cli/; the old names run the same
  program: its refusal, its exit status."""
  import subprocess
  for old in ('train.generate', 'train.evaluate', 'train.export_hf'):
    args = [f'--workdir={tmp_path}/none'] + (['--prompt=x'] if old == 'train.generate' else
                                             ['--out=x'] if old == 'train.export_hf' else [])
    env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}
    done = subprocess.run([*python(env), '-m', old, *args], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode != 0 and 'error:' in done.stderr and f'{tmp_path}/none' in done.stderr, (
        old, done.returncode, done.stderr[-2000:])
