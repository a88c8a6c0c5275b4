"""Ours against the yardsticks, side by side in one command: the same decoder trained by

- `torch`: a plain PyTorch eager loop (bench/eager_torch.py, 2 threads unless --torch_threads);
- `plain_jax`: plain JAX + optax written without care (bench/plain_jax.py): the floor;
- `ours_step`: our compiled train step alone, on batches already on the device (what
  `bench.train_step` times);
- `ours_loop`: our real training loop, `python main.py` (data pipeline, logging, non-finite checks;
  tokens/s from the run's metrics.jsonl, which leaves out evaluations and checkpoint saves).

Each program runs in a process of its own, compiled and warmed up once; rounds are interleaved (every
program in turn, `--rounds` times, pausing between them so no program's idle threads spin into the
next) and each program's best round is reported, with its ratio to PyTorch's and to plain JAX's.
`ours_loop` starts main.py anew each round (its compile is outside the timed interval).

  python -m bench.versus                                   # the issue-29 shape, fp32
  python -m bench.versus --shape=small --precision=bf16    # the default preset's shape, bf16
  python -m bench.versus --programs=torch,ours_step --out=versus.json

`--precision=bf16` is pure bf16 everywhere (PyTorch's `model.to(torch.bfloat16)`; ours
precision=bf16); `--ours_precision=bf16_mixed` times ours in another precision beside it. Our rows
are plain causal (data.packing=False), as the other programs' are, unless --packing.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from bench.measure import SHAPES

PROGRAMS = ('torch', 'plain_jax', 'ours_step', 'ours_loop')
MODEL_KEYS = ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
              'mlp_dim', 'tie_embeddings')

_SHAPE = flags.DEFINE_enum('shape', 'issue', list(SHAPES), 'Model and batch shape.')
_PRECISION = flags.DEFINE_enum('precision', 'fp32', ['fp32', 'bf16'], 'fp32, or pure bf16.')
_OURS_PRECISION = flags.DEFINE_string('ours_precision', None, 'Our precision (default: --precision).')
_PROGRAMS = flags.DEFINE_list('programs', list(PROGRAMS), f'Any of {", ".join(PROGRAMS)}.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Interleaved rounds; each program\'s best is reported.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per program per round.')
_WARMUP = flags.DEFINE_integer('warmup', 5, 'Untimed steps once, after the compile.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 2, 'torch.set_num_threads.')
_PACKING = flags.DEFINE_bool('packing', False, 'Our rows packed (segment ids), as main.py by default.')
_ATTENTION = flags.DEFINE_string('attention', 'auto', 'Our model.attention.')
_OVERRIDES = flags.DEFINE_multi_string('ours', [], 'More overrides of ours, key=value (e.g. '
                                       'model.remat=full).')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')
_WORKER = flags.DEFINE_string('worker', None, 'Internal: run as this program\'s worker process.')
_SPEC = flags.DEFINE_string('spec', None, 'Internal: the worker\'s shape, as JSON.')


def our_overrides(spec: dict) -> list[str]:
  """--config.* flags that make configs/default.py:small the compared model and batch."""
  flags_ = [f'--config.model.{k}={spec[k]}' for k in MODEL_KEYS]
  flags_ += [f'--config.train.batch_size={spec["batch_size"]}',
             f'--config.train.seq_len={spec["seq_len"]}',
             f'--config.precision={spec["ours_precision"]}',
             f'--config.data.packing={spec["packing"]}',
             f'--config.model.attention={spec["attention"]}']
  return flags_ + [f'--config.{o}' for o in spec['overrides']]


def typed(config, key: str, text: str):
  """`text` as the type of the config value at dotted `key` (as a --config.key=text flag parses it)."""
  node = config
  for part in key.split('.'):
    node = node[part]
  if isinstance(node, bool):
    return text == 'True'
  return type(node)(text)


# ---- the workers: one program each, compiled and warmed up once, then `run N` on request ----------
class OurStep:
  """Our compiled step on random batches already on the device."""

  def __init__(self, spec: dict):
    import jax
    import numpy as np

    import configs
    from configs.default import override
    from data.windows import batch_keys
    from train import init_from
    from train.run import compile_train_step, setup
    config = configs.load('configs/default.py:small')
    for flag in our_overrides(spec):
      key, value = flag[len('--config.'):].split('=', 1)
      override(config, key, typed(config, key, value))
    self.jax = jax
    s = setup(config, devices=jax.devices()[:1])
    self.compiled = compile_train_step(s)
    self.state = init_from.fresh_state(s)
    rng = np.random.default_rng(0)
    rows, length = spec['batch_size'], spec['seq_len']

    def batch():
      tokens = rng.integers(0, spec['vocab_size'], (rows, length + 1), np.int32)
      arrays = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:],
                'segments': np.ones((rows, length), np.int32)}
      return {k: jax.device_put(arrays[k], s.batch_sharding) for k in batch_keys(spec['packing'])}
    self.batches = [batch() for _ in range(8)]
    self.loss = float('nan')

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for i in range(steps):
      self.state, metrics = self.compiled(self.state, self.batches[i % len(self.batches)])
    self.loss = float(metrics['loss'])
    return time.perf_counter() - start


def make_worker(name: str, spec: dict):
  if name == 'torch':
    from bench import eager_torch
    return eager_torch.Trainer(spec, spec['torch_threads'])
  if name == 'plain_jax':
    from bench import plain_jax
    return plain_jax.Trainer(spec)
  if name == 'ours_step':
    return OurStep(spec)
  raise app.UsageError(f'--worker={name!r}; allowed: torch, plain_jax, ours_step')


def serve(name: str, spec: dict) -> None:
  """Warm up, say `ready`, then answer each `run N` line with {"seconds", "loss"} on stdout."""
  worker = make_worker(name, spec)
  worker.run(spec['warmup'])
  print(json.dumps({'ready': name}), flush=True)
  for line in sys.stdin:
    steps = int(line.split()[1])
    seconds = worker.run(steps)
    print(json.dumps({'seconds': seconds, 'loss': float(worker.loss)}), flush=True)


class Worker:
  """A worker process seen from the driver."""

  def __init__(self, name: str, spec: dict):
    self.name = name
    self.process = subprocess.Popen(
        [sys.executable, '-m', 'bench.versus', f'--worker={name}', f'--spec={json.dumps(spec)}'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    self._answer()   # ready

  def _answer(self) -> dict:
    for line in self.process.stdout:
      if line.startswith('{'):
        return json.loads(line)
    raise RuntimeError(f'the {self.name} worker ended (exit code {self.process.wait()})')

  def run(self, steps: int) -> dict:
    self.process.stdin.write(f'run {steps}\n')
    self.process.stdin.flush()
    return self._answer()

  def close(self) -> None:
    self.process.stdin.close()
    self.process.wait()


class OurLoop:
  """`python main.py` for warmup + steps steps in a fresh workdir; the timed interval is the
  metrics row of its last `steps` steps (evaluations and checkpoint saves left out by the loop)."""

  def __init__(self, spec: dict, scratch: str):
    self.spec, self.scratch, self.data_path, self.rounds = spec, scratch, '', 0

  def run(self, steps: int) -> dict:
    spec, warmup = self.spec, self.spec['warmup']
    self.rounds += 1
    workdir = os.path.join(self.scratch, f'loop-{self.rounds}')
    tokens = spec['batch_size'] * spec['seq_len']
    command = [sys.executable, 'main.py', '--config=configs/default.py:small',
               f'--workdir={workdir}', *our_overrides(spec),
               f'--config.train.steps={warmup + steps}', f'--config.train.log_every={steps}',
               '--config.train.warmup_steps=1', f'--config.train.eval_every={warmup + steps}',
               f'--config.train.checkpoint_every={warmup + steps}',
               f'--config.train.eval_tokens={tokens}', '--config.sample.length=1']
    if warmup % steps:   # the interval must start after the warm-up: log at warmup, then at the end
      raise app.UsageError(f'--warmup={warmup} must be a multiple of --steps={steps} for ours_loop '
                           f'(its metrics rows come every --steps steps)')
    if self.data_path:
      command.append(f'--config.data.path={self.data_path}')
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not self.data_path:   # later rounds read the first one's prepared cache
      cache = os.path.join(workdir, 'data')
      self.data_path = os.path.join(cache, os.listdir(cache)[0])
    with open(os.path.join(workdir, 'metrics.jsonl')) as f:
      rows = {r['step']: r for r in map(json.loads, f)}
    last = rows[warmup + steps]
    return {'seconds': steps * tokens / last['tokens_per_sec'], 'loss': last['loss']}

  def close(self) -> None:
    pass


def main(argv):
  del argv
  if _WORKER.value:
    return serve(_WORKER.value, json.loads(_SPEC.value))
  unknown = set(_PROGRAMS.value) - set(PROGRAMS)
  if unknown:
    raise app.UsageError(f'--programs has {", ".join(sorted(unknown))}; allowed: {", ".join(PROGRAMS)}')
  spec = {**SHAPES[_SHAPE.value], 'precision': _PRECISION.value,
          'ours_precision': _OURS_PRECISION.value or _PRECISION.value, 'packing': _PACKING.value,
          'attention': _ATTENTION.value, 'overrides': _OVERRIDES.value,
          'warmup': _WARMUP.value, 'torch_threads': _TORCH_THREADS.value}
  tokens = spec['batch_size'] * spec['seq_len']
  with tempfile.TemporaryDirectory() as scratch:
    workers = {name: OurLoop(spec, scratch) if name == 'ours_loop' else Worker(name, spec)
               for name in _PROGRAMS.value}
    rates = {name: [] for name in workers}
    losses = {}
    try:
      for _ in range(_ROUNDS.value):
        for name, worker in workers.items():
          time.sleep(1.0)   # idle threads of the previous program stop spinning
          answer = worker.run(_STEPS.value)
          rates[name].append(_STEPS.value * tokens / answer['seconds'])
          losses[name] = answer['loss']
    finally:
      for worker in workers.values():
        worker.close()
  best = {name: max(r) for name, r in rates.items()}
  print(f'{_SHAPE.value} shape ({", ".join(f"{k} {v}" for k, v in SHAPES[_SHAPE.value].items())}), '
        f'{spec["precision"]} (ours {spec["ours_precision"]}), {_STEPS.value} steps x '
        f'{_ROUNDS.value} interleaved rounds, best round:')
  for name, rate in best.items():
    ratios = [f'{rate / best[ref]:.2f}x {ref}' for ref in ('torch', 'plain_jax')
              if ref in best and ref != name]
    print(f'  {name:10s} {rate:9,.0f} tokens/s  (rounds: '
          f'{", ".join(f"{r:,.0f}" for r in rates[name])})  {"  ".join(ratios)}')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'spec': spec, 'steps': _STEPS.value, 'rounds': rates, 'best_tokens_per_sec': best,
                 'losses': losses}, f, indent=2)


if __name__ == '__main__':
  app.run(main)
