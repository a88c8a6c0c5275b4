"""The classic memory table (1B: 4 GB to store in fp32, 24 GB to train; 175B: 4.2 TB; 500B: 12 TB)
from the analytic memory model, beside what this project's recipes need per device, as markdown and
as a log-scale bar chart. Assumptions: bench/classic_memory.py's docstring. Nothing is compiled or run.

  python -m bench.studies.classic [--png=bench/results/classic_memory.png]
"""
from absl import app, flags, logging

_PNG = flags.DEFINE_string('png', 'bench/results/classic_memory.png',
                           'Where to write the bar chart (empty: no chart).')

GPU_MEMORY_GB = 80
COLORS = ('tab:gray', 'tab:blue', 'tab:green', 'tab:orange', 'tab:purple')


def _gb(n: float) -> str:
  gb = n / 1e9
  if gb >= 1000:
    return f'{gb:,.0f}'
  return f'{gb:.1f}' if gb >= 10 else f'{gb:.2f}'


def markdown() -> str:
  from bench import classic_memory as classic
  formats = classic.STORAGE_FORMATS
  lines = ['Storing the weights (GB = 1e9 bytes; no quantization scales, as in the classic '
           'figures)', '',
           '| model | parameters | ' + ' | '.join(f'{f} (GB)' for f in formats) + ' |',
           '|---|---:|' + '---:|' * len(formats)]
  for name, cfg in classic.MODELS.items():
    stored = classic.storage_bytes(cfg)
    lines.append(f'| {name} | {cfg.num_params / 1e9:.2f} B | '
                 + ' | '.join(_gb(stored[f]) for f in formats) + ' |')
  lines.append('| classic figure, 1B | 1 B | '
               + ' | '.join(_gb(b) for b in classic.CLASSIC_STORAGE.values()) + ' |')
  lines += ['', f'Training, per device (GB = 1e9 bytes; one {classic.SEQ_LEN}-token sequence per '
            'device and full remat for every recipe but the classic)', '',
            '| model | recipe | devices | state (bytes/param) | state per device (GB) '
            '| activations + temporaries per device (GB) | total per device (GB) '
            '| state ÷ classic state | total ÷ classic total | fits 80 GB |',
            '|---|---|---:|---:|---:|---:|---:|---:|---:|---|']
  for r in classic.training_rows():
    lines.append(f'| {r.model} | {r.recipe} | {r.devices} | {r.state_bytes_per_param:.2f} '
                 f'| {_gb(r.state)} | {_gb(r.activations)} | {_gb(r.total)} '
                 f'| {r.state_vs_classic:.4f} | {r.total_vs_classic:.4f} '
                 f'| {"yes" if r.total <= GPU_MEMORY_GB * 1e9 else "no"} |')
  figures = ', '.join(f'{m} {_gb(b)} GB' for m, b in classic.CLASSIC_TRAINING.items())
  sequences = ', '.join(f'{m} {classic.classic_activation_sequences(m):.2f}'
                        for m in classic.MODELS)
  lines += ['', f'Classic training figures: {figures}. The classic row is 16 bytes/param of state '
            f'(estimate(), fp32 + Adam) plus the classic rule of '
            f'{classic.CLASSIC_ACTIVATION_BYTES_PER_PARAM} bytes/param of activations and '
            f'temporaries; in {classic.SEQ_LEN}-token sequences of estimate()\'s fp32, no-remat '
            f'activations that rule is: {sequences}.',
            'LoRA / QLoRA: not rows of this table; their memory is measured by '
            '`python -m bench.studies.finetune` (WORKSPACE, "Memory: full fine-tuning vs LoRA vs '
            'QLoRA").']
  return '\n'.join(lines)


def write_png(path: str) -> None:
  import os

  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt
  import numpy as np

  from bench import classic_memory as classic
  rows = classic.training_rows()
  models, recipes = list(classic.MODELS), [r.name for r in classic.RECIPES]
  width = 0.8 / len(recipes)
  fig, ax = plt.subplots(figsize=(11, 6))
  for i, recipe in enumerate(recipes):
    values = [next(r.total for r in rows if r.model == m and r.recipe == recipe) / 1e9
              for m in models]
    label = recipe + (' over ' + '/'.join(str(classic.DEVICES[m]) for m in models) + ' devices'
                      if 'ZeRO-3' in recipe else '')
    x = np.arange(len(models)) + (i - (len(recipes) - 1) / 2) * width
    bars = ax.bar(x, values, width, label=label, color=COLORS[i % len(COLORS)])
    for bar, v in zip(bars, values):
      ax.annotate(_gb(v * 1e9), (bar.get_x() + bar.get_width() / 2, v), ha='center',
                  va='bottom', fontsize=7, rotation=90, xytext=(0, 2), textcoords='offset points')
  ax.axhline(GPU_MEMORY_GB, color='red', linestyle='--', linewidth=1,
             label=f'{GPU_MEMORY_GB} GB GPU memory')
  ax.set_yscale('log')
  ax.set_ylim(1, 1e5)
  ax.set_xticks(np.arange(len(models)),
                [f'{m} ({classic.MODELS[m].num_params / 1e9:.1f} B params)' for m in models])
  ax.set_ylabel('memory to train, per device (GB = 1e9 bytes)')
  ax.set_title('The classic figure (fp32 + Adam, 24 bytes/param) and this project\'s recipes')
  ax.legend(fontsize=8, loc='upper left')
  fig.tight_layout()
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.savefig(path, dpi=120)
  plt.close(fig)


def main(argv):
  del argv
  logging.set_verbosity(logging.WARNING)
  print(markdown())
  if _PNG.value:
    write_png(_PNG.value)
    print(f'\nchart: {_PNG.value}')


if __name__ == '__main__':
  app.run(main)
