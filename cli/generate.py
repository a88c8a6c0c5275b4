"""`python -m cli.generate`: samples text from a trained run, with the key/value cache.

  python -m cli.generate --workdir=runs/default --prompt='def ' --max_tokens=64 --seed=0
  python -m cli.generate --workdir=RUN --prompt_file=prompts.txt --rows=4 --temperature=0.7 \
      --top_p=0.9 --step=1000

The run's config (`WORKDIR/config.json`) and its newest checkpoint (or `--step`) are restored on one
device, whatever mesh the run trained on (train/ptq.py:restore_weights), with the run's tokenizer;
a LoRA run samples with its adapters on the frozen base, a run initialised from a Hugging Face
model with its imported vocabulary. Every prompt (one per line of `--prompt_file`) is followed by
`--rows` samples, all in one batch (train/sample.py). The same seed gives the same text. It prints
each continuation and the generation's speed in new tokens per second, compile excluded.

Refused in one line, before anything is compiled: a workdir that holds no run, no checkpoint (or
not the `--step` asked for), an empty prompt, and a prompt longer than the model's context
(`model.max_seq_len` positions, one of which the first new token needs).
"""
import argparse
import json
import sys

import jax

from data import DataError
from train.checkpoint import CheckpointError
from train.checks import ConfigError
from train.generate import generate_text, read_prompts


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog='python -m cli.generate',
                                   description=__doc__.split('\n')[0])
  parser.add_argument('--workdir', required=True, help='the run directory')
  parser.add_argument('--prompt', default=None, help='the text to continue')
  parser.add_argument('--prompt_file', default=None, help='a file of prompts, one a line')
  parser.add_argument('--max_tokens', type=int, default=128, help='new tokens per sample')
  parser.add_argument('--temperature', type=float, default=0.8, help='0: greedy')
  parser.add_argument('--top_k', type=int, default=0, help='sample among the k most likely (0: all)')
  parser.add_argument('--top_p', type=float, default=1.0,
                      help='sample among the most likely tokens holding this probability (1: all)')
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--rows', type=int, default=1, help='samples per prompt')
  parser.add_argument('--step', type=int, default=None, help='the checkpoint (default: newest)')
  parser.add_argument('--host_devices', type=int, default=None,
                      help='with no accelerator, simulate N CPU devices (default: one)')
  args = parser.parse_args(argv)
  if args.host_devices:
    jax.config.update('jax_num_cpu_devices', args.host_devices)
  try:
    prompts = read_prompts(args.prompt, args.prompt_file)
    result = generate_text(args.workdir, prompts, max_tokens=args.max_tokens,
                           temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                           seed=args.seed, rows=args.rows, step=args.step)
  except (ConfigError, CheckpointError, DataError, ValueError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  for prompt, samples in zip(prompts, result['texts']):
    for row, text in enumerate(samples):
      print(f'--- prompt {json.dumps(prompt)}, sample {row + 1} of {len(samples)}:')
      print(text)
  rate = result['new_tokens'] / max(result['run_s'], 1e-9)
  print(f'generate    {result["new_tokens"]:,} new tokens from step {result["step"]} in '
        f'{result["run_s"]:.2f} s: {rate:,.0f} tokens/s (compile {result["compile_s"]:.1f} s, '
        f'{jax.devices()[0].platform})')
  return 0


if __name__ == '__main__':
  sys.exit(main())
