"""Which quantized matmul the dense layers run: the `quant.*` config keys, read once into a frozen
recipe that travels inside the precision policy (so the model code never mentions quantization).

Modes (`quant.mode`):
  none      the policy's compute dtype (fp32, bf16 or fp16)
  int8      quantization-aware training: activations per token and weights per output channel to
            int8, an int8 x int8 -> int32 product; gradients in int8 too with `quant.int8_backward`
  int4      int4 weights (per output channel, or blocks of `quant.block_size` along the input),
            activations in the compute dtype; `quant.learned_scale` learns the step sizes (LSQ)
  fp8       e4m3 activations and weights, e5m2 gradients; `quant.fp8_scaling` 'current' takes each
            scale from the tensor's own absmax (Qwix), 'delayed' from the max over the last
            `quant.amax_history` steps (quant/fp8.py)
  llm_int8  LLM.int8(): outlier feature columns (|x| > `quant.threshold`) in 16 bits, the rest int8
"""
import dataclasses

MODES = ('none', 'int8', 'int4', 'fp8', 'llm_int8')
FP8_SCALING = ('current', 'delayed')


@dataclasses.dataclass(frozen=True)
class MatmulRecipe:
  mode: str = 'none'
  block_size: int = 0            # 0: one scale per channel/token; n: one per n inputs (subchannel)
  int8_backward: bool = False    # int8 mode: quantize the incoming gradients too
  learned_scale: bool = False    # int4 mode: LSQ step sizes trained with the weights
  threshold: float = 6.0         # llm_int8 mode: outlier magnitude
  fp8_scaling: str = 'current'   # fp8 mode: 'current' or 'delayed' (amax history)
  amax_history: int = 16         # fp8 delayed scaling: steps of history

  @property
  def delayed_scaling(self) -> bool:
    return self.mode == 'fp8' and self.fp8_scaling == 'delayed'

  @property
  def product(self) -> str:
    """The name of the product quant/matmul.py runs: the mode, or its learned/delayed variant."""
    if self.learned_scale:
      return 'int4_learned'
    return 'fp8_delayed' if self.delayed_scaling else self.mode

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f'quant.mode={self.mode!r}; allowed: {", ".join(MODES)}')
    if not isinstance(self.block_size, int) or self.block_size < 0:
      raise ValueError(f'quant.block_size={self.block_size!r}; allowed: 0 (per channel) or a '
                       f'positive integer dividing every input dimension')
    if self.block_size and self.mode not in ('int8', 'int4', 'fp8'):
      raise ValueError(f'quant.block_size={self.block_size} applies to modes int8, int4 and fp8, '
                       f'not quant.mode={self.mode!r}; use 0')
    if self.learned_scale and self.mode != 'int4':
      raise ValueError(f'quant.learned_scale=True applies to quant.mode=int4 only, not '
                       f'{self.mode!r}')
    if self.learned_scale and self.block_size:
      raise ValueError('quant.learned_scale=True learns one step size per output channel; '
                       f'set quant.block_size=0 (got {self.block_size})')
    if self.int8_backward and self.mode != 'int8':
      raise ValueError(f'quant.int8_backward=True applies to quant.mode=int8 only, not '
                       f'{self.mode!r}')
    if self.fp8_scaling not in FP8_SCALING:
      raise ValueError(f'quant.fp8_scaling={self.fp8_scaling!r}; allowed: {", ".join(FP8_SCALING)}')
    if self.fp8_scaling == 'delayed' and self.block_size:
      raise ValueError('quant.fp8_scaling=delayed keeps one scale per tensor; set '
                       f'quant.block_size=0 (got {self.block_size})')
    if not isinstance(self.amax_history, int) or self.amax_history < 1:
      raise ValueError(f'quant.amax_history={self.amax_history!r}; allowed: an integer >= 1')
    if not self.threshold > 0:
      raise ValueError(f'quant.threshold={self.threshold!r}; allowed: a number > 0')

  @classmethod
  def from_config(cls, quant) -> 'MatmulRecipe':
    return cls(mode=quant.mode, block_size=quant.block_size, int8_backward=quant.int8_backward,
               learned_scale=quant.learned_scale, threshold=quant.threshold,
               fp8_scaling=quant.fp8_scaling, amax_history=quant.amax_history)

  def check_inputs(self, input_dims: dict[str, int]) -> None:
    """`input_dims`: name -> size of each innermost contraction dimension of the model's matmuls."""
    for name, size in input_dims.items():
      if self.block_size and size % self.block_size:
        raise ValueError(f'quant.block_size={self.block_size} does not divide {name}={size}; use a '
                         f'divisor of every input dimension ({_sizes(input_dims)})')
      if self.mode == 'int4' and size % 2:
        raise ValueError(f'quant.mode=int4 packs two values per byte along the input dimension, '
                         f'but {name}={size} is odd; use even sizes ({_sizes(input_dims)})')


def describe(recipe: MatmulRecipe) -> str:
  """One line for the run summary."""
  details = {'block_size': recipe.block_size or None, 'int8_backward': recipe.int8_backward or None,
             'learned_scale': recipe.learned_scale or None,
             'threshold': recipe.threshold if recipe.mode == 'llm_int8' else None,
             'scaling': recipe.fp8_scaling if recipe.mode == 'fp8' else None,
             'amax_history': recipe.amax_history if recipe.delayed_scaling else None}
  extra = ', '.join(f'{k}={v}' for k, v in details.items() if v is not None)
  return recipe.mode + (f' ({extra})' if extra else '')


def _sizes(dims: dict[str, int]) -> str:
  return ', '.join(f'{k}={v}' for k, v in dims.items())
