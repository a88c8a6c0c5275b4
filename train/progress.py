"""The training loop's progress report: a redrawn bar on a terminal, one plain line per log step
where the output goes to a file (a cluster job's log), and an ETA that counts evaluations and
checkpoint saves apart from the steps.

The bar (tqdm, on stderr) is drawn only when stdout and stderr are both terminals; otherwise each
log step prints one line on stdout:

  step 120/500 (24 %): loss 1.8350, 5,291 tokens/s, MFU 41.2 %, ETA 3 min 12 s

MFU is the model's training FLOPs per second (ModelConfig.flops_per_token) against the datasheet
bf16 peak of the devices (configs/hardware.py), shown where the device is one listed there. The
ETA is the steps left at the step time of the last log interval (which leaves evaluations and
saves out), plus the evaluations and checkpoint saves still due at the time the last of each took.
"""
import sys

from tqdm import tqdm


def duration(seconds: float) -> str:
  seconds = int(round(seconds))
  if seconds < 60:
    return f'{seconds} s'
  if seconds < 3600:
    return f'{seconds // 60} min {seconds % 60} s'
  return f'{seconds // 3600} h {seconds % 3600 // 60} min'


def due(start: int, end: int, every: int) -> int:
  """How many of the steps start + 1 .. end are multiples of `every` (or the last one)."""
  if end <= start:
    return 0
  return (end // every - start // every) + (0 if end % every == 0 else 1)


class Progress:
  """`step()` after every step; `log(step, row)` at log steps; `evaluated(s)` and `saved(s)` with
  how long each took. `peak_flops`: the devices' bf16 peak together (None: no MFU)."""

  def __init__(self, train, start: int, enabled: bool, flops_per_token: float,
               peak_flops: float | None, terminal: bool | None = None):
    self.train, self.enabled = train, enabled
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self.terminal = (sys.stdout.isatty() and sys.stderr.isatty()) if terminal is None else terminal
    self.step_seconds = None
    self.eval_seconds = self.save_seconds = 0.0
    self.bar = tqdm(total=train.steps, initial=start, disable=not (enabled and self.terminal),
                    unit='step', dynamic_ncols=True,
                    bar_format='{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}{postfix}]')

  def step(self) -> None:
    self.bar.update(1)

  def evaluated(self, seconds: float) -> None:
    self.eval_seconds = seconds

  def saved(self, seconds: float) -> None:
    self.save_seconds = seconds

  def eta(self, step: int) -> float | None:
    """Seconds left: the steps at the last interval's step time, the evaluations and saves due."""
    if self.step_seconds is None:
      return None
    train = self.train
    return ((train.steps - step) * self.step_seconds
            + due(step, train.steps, train.eval_every) * self.eval_seconds
            + due(step, train.steps, train.checkpoint_every) * self.save_seconds)

  def log(self, step: int, row: dict, interval_steps: int, interval_seconds: float) -> None:
    self.step_seconds = interval_seconds / max(interval_steps, 1)
    figures = [f'loss {row["loss"]:.4f}', f'{row["tokens_per_sec"]:,.0f} tokens/s']
    if self.peak_flops:
      figures.append(f'MFU {100 * row["tokens_per_sec"] * self.flops_per_token / self.peak_flops:.1f} %')
    eta = self.eta(step)
    if eta is not None and step < self.train.steps:
      figures.append(f'ETA {duration(eta)}')
    if not self.enabled:
      return
    if self.terminal:
      self.bar.set_postfix_str(', '.join(figures))
    else:
      print(f'step {step}/{self.train.steps} ({100 * step // self.train.steps} %): '
            f'{", ".join(figures)}', flush=True)

  def close(self) -> None:
    self.bar.close()
