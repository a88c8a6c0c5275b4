"""Samples text from a trained run, with the key/value cache (the program: `python -m
cli.generate`).

The run's config (`WORKDIR/config.json`) and its newest checkpoint (or `step`) are restored on one
device, whatever mesh the run trained on (train/ptq.py:restore_weights), with the run's tokenizer;
a LoRA run samples with its adapters on the frozen base, a run initialised from a Hugging Face
model with its imported vocabulary. Every prompt is followed by `rows` samples, all in one batch
(train/sample.py). The same seed gives the same text.

Refused in one line, before anything is compiled: a workdir that holds no run, no checkpoint (or
not the step asked for), an empty prompt, and a prompt longer than the model's context
(`model.max_seq_len` positions, one of which the first new token needs).
"""
import os

from configs import default
from train import ptq
from train.checkpoint import Checkpointer, CheckpointError
from train.checks import ConfigError
from train.sample import generate_batch


def read_prompts(prompt: str | None, prompt_file: str | None) -> list[str]:
  if (prompt is None) == (prompt_file is None):
    raise ConfigError('give one of --prompt=TEXT and --prompt_file=FILE (one prompt a line)')
  if prompt_file is not None:
    if not os.path.isfile(prompt_file):
      raise ConfigError(f'--prompt_file={prompt_file!r} does not exist')
    with open(prompt_file, encoding='utf-8') as f:
      prompts = [line.rstrip('\n') for line in f if line.strip()]
    if not prompts:
      raise ConfigError(f'--prompt_file={prompt_file!r} holds no prompt (one a line)')
    return prompts
  if not prompt:
    raise ConfigError('--prompt is empty; give at least one character')
  return [prompt]


def check_run(workdir: str, step: int | None) -> int:
  """The step to sample from, or CheckpointError in one line."""
  if not os.path.isfile(os.path.join(workdir, 'config.json')):
    raise CheckpointError(f'--workdir={workdir!r} holds no run (no config.json): give the '
                          'directory a training run wrote')
  directory = os.path.join(workdir, 'checkpoints')
  steps = Checkpointer(directory, keep=1 << 30).steps() if os.path.isdir(directory) else []
  if not steps:
    raise CheckpointError(f'--workdir={workdir!r} holds no checkpoint to sample from; train it '
                          'for at least train.checkpoint_every steps first')
  if step is None:
    return steps[0]
  if step not in steps:
    raise CheckpointError(f'--step={step}: {workdir} has checkpoints at steps '
                          f'{", ".join(map(str, sorted(steps)))}')
  return step


def generate_text(workdir: str, prompts: list[str], *, max_tokens: int = 128,
                  temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0,
                  rows: int = 1, step: int | None = None) -> dict:
  """{'texts': [[prompt + sample per row] per prompt], 'step', and the timing}."""
  from train import run   # the layer above ptq's; imported here as ptq does
  if max_tokens < 1 or rows < 1:
    raise ConfigError(f'--max_tokens={max_tokens} and --rows={rows} must be at least 1')
  step = check_run(workdir, step)
  config = ptq.run_config(workdir, default.get_config())
  tokenizer = run.make_tokenizer(config)
  window = config.model.max_seq_len
  encoded = [tokenizer.encode(p) for p in prompts]
  for text, ids in zip(prompts, encoded):
    if len(ids) == 0:
      raise ConfigError(f'the prompt {text!r} encodes to no token')
    if len(ids) >= window:
      raise ConfigError(f'a prompt of {len(ids)} tokens does not fit the model\'s context of '
                        f'{window} positions (model.max_seq_len) with a token to generate; give '
                        f'at most {window - 1}')
  params, frozen, s = ptq.restore_weights(workdir, config, step, with_setup=True)
  timing = {}
  outputs = generate_batch(s.layout.graphdef, params, [ids for ids in encoded for _ in range(rows)],
                           num_tokens=max_tokens, window=window, temperature=temperature,
                           top_k=top_k, top_p=top_p, seed=seed, vocab_limit=tokenizer.vocab_size,
                           frozen=frozen or None, model_shapes=s.layout.model_shapes,
                           timing=timing)
  texts = [[tokenizer.decode(out) for out in outputs[i * rows:(i + 1) * rows]]
           for i in range(len(prompts))]
  return {'texts': texts, 'step': step, **timing}


if __name__ == '__main__':   # the old command; the program is cli/generate.py
  import runpy
  runpy.run_module('cli.generate', run_name='__main__', alter_sys=True)
