"""Ours against the yardsticks, side by side in one command: the same decoder trained by

- `torch`: a plain PyTorch eager loop (bench/eager_torch.py; on the CPU with 2 threads unless
  --torch_threads, on CUDA where torch sees a GPU);
- `torch_compile`: the same loop with its forward and loss under `torch.compile`;
- `plain_jax`: plain JAX + optax written without care (bench/plain_jax.py): the floor;
- `ours_step`: our compiled train step alone, on batches already on the device (what
  `bench.train_step` times);
- `ours_loop`: our real training loop, `python main.py` (data pipeline, logging, non-finite checks;
  tokens/s from the run's metrics.jsonl, which leaves out evaluations and checkpoint saves).

Each program runs in a process of its own, compiled and warmed up once (where rounds are
interleaved, the processes start, compile and warm up side by side: none is timed then; ours_loop
compiles in each round instead); on the CPU rounds are interleaved (every program in turn,
`--rounds` times, pausing between them so no program's idle threads spin into the next). On a GPU
the programs run one at a time (each process's rounds, then the next process): two 1b trainings
do not fit one GPU's memory side by side. Each program's best round is reported, with its ratio to
the others'. `ours_loop` starts main.py anew each round (its compile is outside the timed interval).

  python -m bench.versus                                   # the issue-29 shape, fp32
  python -m bench.versus --shape=small --precision=bf16    # the default preset's shape, bf16
  python -m bench.versus --programs=torch,ours_step --out=versus.json
  python -m bench.versus --shape=1b --precision=bf16_mixed --programs=torch,torch_compile,ours_step \
      --ours=model.remat=none --steps=10 --warmup=3 --rounds=2    # issue 47, on one GPU

`--precision=bf16` is pure bf16 everywhere (PyTorch's `model.to(torch.bfloat16)`; ours
precision=bf16); `bf16_mixed` is fp32 weights and Adam with bf16 compute everywhere (PyTorch's
autocast); `--ours_precision=bf16_mixed` times ours in another precision beside it. Our rows are
plain causal (data.packing=False), as the other programs' are, unless --packing.
"""
import json
import os
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from bench.shapes import SHAPES, our_config, our_overrides
from train.metrics import read_rows

PROGRAMS = ('torch', 'torch_compile', 'plain_jax', 'ours_step', 'ours_loop')
_SHAPE = flags.DEFINE_enum('shape', 'issue', list(SHAPES), 'Model and batch shape.')
_PRECISION = flags.DEFINE_enum('precision', 'fp32', ['fp32', 'bf16', 'bf16_mixed'],
                               'fp32, pure bf16, or bf16 compute over fp32 weights.')
_OURS_PRECISION = flags.DEFINE_string('ours_precision', None, 'Our precision (default: --precision).')
_PROGRAMS = flags.DEFINE_list('programs', list(PROGRAMS), f'Any of {", ".join(PROGRAMS)}.')
_ROUNDS = flags.DEFINE_integer('rounds', 3, 'Rounds of each program; its best is reported.')
_STEPS = flags.DEFINE_integer('steps', 20, 'Timed steps per program per round.')
_WARMUP = flags.DEFINE_integer('warmup', 5, 'Untimed steps once, after the compile.')
_TORCH_THREADS = flags.DEFINE_integer('torch_threads', 2, 'torch.set_num_threads.')
_TORCH_DEVICE = flags.DEFINE_enum('torch_device', 'auto', ['auto', 'cpu', 'cuda'],
                                  'Where PyTorch runs; auto: CUDA where torch sees a GPU.')
_ORDER = flags.DEFINE_enum('order', 'auto', ['auto', 'interleaved', 'one_at_a_time'],
                           'Rounds of every program in turn, or each program\'s rounds at once; '
                           'auto: one at a time on a GPU.')
_PACKING = flags.DEFINE_bool('packing', False, 'Our rows packed (segment ids), as main.py by default.')
_ATTENTION = flags.DEFINE_string('attention', 'auto', 'Our model.attention.')
_OVERRIDES = flags.DEFINE_multi_string('ours', [], 'More overrides of ours, key=value (e.g. '
                                       'model.remat=full).')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')
_WORKER = flags.DEFINE_string('worker', None, 'Internal: run as this program\'s worker process.')
_SPEC = flags.DEFINE_string('spec', None, 'Internal: the worker\'s shape, as JSON.')


# ---- the workers: one program each, compiled and warmed up once, then `run N` on request ----------
class OurStep:
  """Our compiled step on random batches already on the device."""

  def __init__(self, spec: dict):
    import jax
    import numpy as np

    from data.windows import batch_keys
    from train import init_from
    from train.run import compile_train_step, setup
    config = our_config(spec)
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
  if name in ('torch', 'torch_compile'):
    from bench import eager_torch
    return eager_torch.Trainer(spec, spec['torch_threads'], spec['torch_device'],
                               compiled=name == 'torch_compile')
  if name == 'plain_jax':
    from bench import plain_jax
    return plain_jax.Trainer(spec)
  if name == 'ours_step':
    return OurStep(spec)
  raise app.UsageError(f'--worker={name!r}; allowed: torch, torch_compile, plain_jax, ours_step')


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
    """Starts the worker; `ready` waits until it has compiled and warmed up."""
    self.name, self.is_ready = name, False
    self.process = subprocess.Popen(
        [sys.executable, '-m', 'bench.versus', f'--worker={name}', f'--spec={json.dumps(spec)}'],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

  def ready(self) -> None:
    self._answer()
    self.is_ready = True

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
    """Ends the worker: a ready one when its input closes, one still compiling (another worker
    failed first) at once."""
    if not self.is_ready:
      self.process.kill()
    self.process.stdin.close()
    self.process.wait()


class OurLoop:
  """`python main.py` for warmup + steps steps in a fresh workdir; the timed interval is the
  metrics row of its last `steps` steps (evaluations and checkpoint saves left out by the loop)."""

  def __init__(self, spec: dict, scratch: str):
    self.spec, self.scratch, self.data_path, self.rounds = spec, scratch, '', 0

  def ready(self) -> None:   # each round compiles its own run
    pass

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
    rows = {r['step']: r for r in read_rows(os.path.join(workdir, 'metrics.jsonl'))}
    last = rows[warmup + steps]
    return {'seconds': steps * tokens / last['tokens_per_sec'], 'loss': last['loss']}

  def close(self) -> None:
    pass


def torch_device(asked: str, programs: list[str]) -> str:
  """`--torch_device` resolved: auto is CUDA where torch sees a GPU (asked only if a PyTorch
  program runs: importing torch takes seconds)."""
  if asked != 'auto' or not {'torch', 'torch_compile'} & set(programs):
    return 'cpu' if asked == 'auto' else asked
  import torch
  return 'cuda' if torch.cuda.is_available() else 'cpu'


def on_accelerator() -> bool:
  """Whether JAX's default backend here is an accelerator (asked in a child process: this one
  must not hold the device's memory its workers need). JAX_PLATFORMS=cpu answers without one."""
  if os.environ.get('JAX_PLATFORMS', '').split(',') == ['cpu']:
    return False
  from bench.gpu import probe_device
  return probe_device()['platform'] != 'cpu'


def timed_rounds(starts: dict, rounds: int, steps: int, one_at_a_time: bool):
  """{program: [seconds of each round]}, {program: its last loss}; `starts` maps each program to a
  function that starts its worker. Interleaved: every worker alive at once, each round every
  program in turn; one at a time: a program's worker started, its rounds, closed, then the next."""
  seconds = {name: [] for name in starts}
  losses = {}
  groups = [[name] for name in starts] if one_at_a_time else [list(starts)]
  for group in groups:
    alive = {}
    try:
      for name in group:   # a group's workers start, compile and warm up side by side
        alive[name] = starts[name]()
      for worker in alive.values():
        worker.ready()
      for _ in range(rounds):
        for name, worker in alive.items():
          time.sleep(1.0)   # idle threads of the previous program stop spinning
          answer = worker.run(steps)
          seconds[name].append(answer['seconds'])
          losses[name] = answer['loss']
          # Said as it comes: a run cut short (a time limit) keeps the rounds it finished.
          print(f'  {name}: {steps} steps in {answer["seconds"]:.3f} s (loss {answer["loss"]:.4f} '
                f'nats/token)', flush=True)
    finally:
      for worker in alive.values():
        worker.close()
  return seconds, losses


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
          'warmup': _WARMUP.value, 'torch_threads': _TORCH_THREADS.value,
          'torch_device': torch_device(_TORCH_DEVICE.value, _PROGRAMS.value)}
  # On a GPU (PyTorch's, or JAX's when a JAX program runs) one program at a time.
  jax_programs = set(_PROGRAMS.value) - {'torch', 'torch_compile'}
  one_at_a_time = (_ORDER.value == 'one_at_a_time' or (_ORDER.value == 'auto' and (
      spec['torch_device'] == 'cuda' or (jax_programs and on_accelerator()))))
  tokens = spec['batch_size'] * spec['seq_len']
  with tempfile.TemporaryDirectory() as scratch:
    starts = {name: (lambda: OurLoop(spec, scratch)) if name == 'ours_loop' else
              (lambda name=name: Worker(name, spec)) for name in _PROGRAMS.value}
    seconds, losses = timed_rounds(starts, _ROUNDS.value, _STEPS.value, one_at_a_time)
  rates = {name: [_STEPS.value * tokens / s for s in runs] for name, runs in seconds.items()}
  best = {name: max(r) for name, r in rates.items()}
  print(f'{_SHAPE.value} shape ({", ".join(f"{k} {v}" for k, v in SHAPES[_SHAPE.value].items())}), '
        f'{spec["precision"]} (ours {spec["ours_precision"]}), PyTorch on {spec["torch_device"]}, '
        f'{_STEPS.value} steps x {_ROUNDS.value} '
        f'{"rounds one program at a time" if one_at_a_time else "interleaved rounds"}, best round:')
  for name, rate in best.items():
    ratios = [f'{rate / best[ref]:.2f}x {ref}' for ref in ('torch', 'torch_compile', 'plain_jax')
              if ref in best and ref != name]
    print(f'  {name:13s} {rate:9,.0f} tokens/s  {1e3 * tokens / rate:8.1f} ms/step  (rounds: '
          f'{", ".join(f"{r:,.0f}" for r in rates[name])})  {"  ".join(ratios)}')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'spec': spec, 'steps': _STEPS.value, 'rounds': rates, 'best_tokens_per_sec': best,
                 'losses': losses, 'one_at_a_time': one_at_a_time}, f, indent=2)


if __name__ == '__main__':
  app.run(main)
