"""Every precision policy and quantized-training recipe, and 8-bit Adam, on the default run, three
seeds each: validation loss against the bytes of model state each keeps per parameter.

  python -m sweep --sweep=sweeps/precision.py --workdir=runs/sweep-precision --parallel=2

The default run (the small preset, 3.2 M parameters, one device, 500 steps of 16 x 128 bytes);
one evaluation at the end over 2^18 held-out tokens (standard error about 0.008 nats/token, under
a third of the seed-to-seed spread this run has shown). The seed sets the initialisation and the
data order, so a seed compares recipes on identical data. Bytes per parameter: weights, gradients
and optimizer state on one device (the analytic model; a quantized-training recipe keeps fp32
master weights, so its saving is in matmul speed on hardware that has the format, not here).
"""
from sweep.grid import axis, choices, product

RECIPES = {
    'fp32': {'precision': 'fp32'},
    'bf16_mixed': {'precision': 'bf16_mixed'},
    'bf16_master': {'precision': 'bf16_master'},
    'bf16': {'precision': 'bf16'},
    'fp16': {'precision': 'fp16'},
    'fp8': {'precision': 'bf16_mixed', 'quant.mode': 'fp8'},
    'fp8_delayed': {'precision': 'bf16_mixed', 'quant.mode': 'fp8', 'quant.fp8_scaling': 'delayed'},
    'int8': {'precision': 'bf16_mixed', 'quant.mode': 'int8'},
    'int4': {'precision': 'bf16_mixed', 'quant.mode': 'int4'},
    'int4_lsq': {'precision': 'bf16_mixed', 'quant.mode': 'int4', 'quant.learned_scale': True},
    'llm_int8': {'precision': 'bf16_mixed', 'quant.mode': 'llm_int8', 'quant.threshold': 6.0},
    'adam8bit': {'precision': 'fp32', 'quant.adam_bits': 8},
    'bf16_master_adam8bit': {'precision': 'bf16_master', 'quant.adam_bits': 8},
    'bf16_adam8bit': {'precision': 'bf16', 'quant.adam_bits': 8},
}


def get_sweep():
  return dict(
      title='Validation loss against bytes per parameter, every precision and quantization recipe',
      command='train',
      config='configs/default.py',
      overrides={'train.eval_every': 500, 'train.eval_tokens': 2**18},
      points=product(choices('recipe', RECIPES), axis('train.seed', [0, 1, 2])),
      metrics=('final_loss', 'final_loss_sem', 'state_bytes_per_param', 'tokens_per_sec',
               'compiled_gb', 'wall_s'),
      charts=(
          dict(file='loss_vs_bytes.png', kind='scatter', x='state_bytes_per_param',
               y='final_loss', series='recipe', dodge=0.01,
               title='Default run, 500 steps: validation loss vs model-state bytes per parameter'),
          dict(file='loss_by_recipe.png', kind='scatter', x='recipe', y='final_loss',
               title='Default run, 500 steps: validation loss per recipe'),
      ),
  )
