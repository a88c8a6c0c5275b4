"""What the `--compose` checks of bench/studies/pipeline.py and bench/studies/context.py run: every
precision, quantization mode and LoRA variant, and the losses of a few train steps of a config."""

# What --compose runs through a layout and on one device.
VARIANTS = {
    'fp32': {},
    'bf16_mixed, remat full': {'precision': 'bf16_mixed', 'model.remat': 'full'},
    'fp16 (loss scaling)': {'precision': 'fp16'},
    'int8': {'precision': 'bf16_mixed', 'quant.mode': 'int8'},
    'int4, learned scales': {'precision': 'bf16_mixed', 'quant.mode': 'int4',
                             'quant.learned_scale': True},
    'fp8 (current scaling)': {'precision': 'bf16_mixed', 'quant.mode': 'fp8'},
    'Adam 8-bit': {'quant.adam_bits': 8},
    'LoRA': {'lora.rank': 4},
    'LoRA, dropout 0.1': {'lora.rank': 4, 'lora.dropout': 0.1},
    'QLoRA (nf4 base)': {'precision': 'bf16_mixed', 'lora.rank': 4, 'quant.weights': 'nf4'},
}


def losses(config, devices, steps: int = 2, packed: bool = False) -> list[float]:
  """The losses of `steps` train steps from the seed's state on random tokens; `packed`: each row
  holds documents of random lengths (segment ids), their first targets not predicted."""
  import jax
  import numpy as np
  from train import run
  s = run.setup(config, devices)
  state, out = s.layout.init(), []
  for i in range(steps):
    rng = np.random.default_rng(i)
    tokens = rng.integers(0, 256, (config.train.batch_size, config.train.seq_len + 1), np.int32)
    batch = {'inputs': tokens[:, :-1], 'targets': tokens[:, 1:]}
    if packed:
      segments = 1 + np.cumsum(rng.random(batch['inputs'].shape) < 0.1, axis=1, dtype=np.int32)
      first = np.concatenate([segments[:, 1:] != segments[:, :-1],
                              np.zeros_like(segments[:, :1], bool)], axis=1)
      batch = {**batch, 'targets': np.where(first, -1, batch['targets']), 'segments': segments}
    with s.context():
      state, metrics = s.train_step(state, {k: jax.device_put(v, s.batch_sharding)
                                            for k, v in batch.items()})
    out.append(float(metrics['loss']))
  return out


def table(layout: str, config_for, packed: bool = False) -> None:
  """Prints, per variant, the losses through `layout` beside one device's and their largest
  relative difference. `config_for(overrides, one_device)` returns (config, devices) for a
  variant's overrides, on the layout or on one device."""
  import sys
  print(f'| variant | {layout} losses (2 steps) | one device | largest relative difference |')
  print('|---|---|---|---:|')
  for name, overrides in VARIANTS.items():
    runs = [losses(*config_for(overrides, one), packed=packed) for one in (False, True)]
    worst = max(abs(a - b) / abs(b) for a, b in zip(*runs))
    print(f'| {name} | {", ".join(f"{x:.6f}" for x in runs[0])} | '
          f'{", ".join(f"{x:.6f}" for x in runs[1])} | {worst:.1e} |')
    sys.stdout.flush()
