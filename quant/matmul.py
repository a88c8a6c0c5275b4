"""The quantized products behind `Dense`, one function per `quant.mode`.

int8, int4 (absmax scales) and fp8 are Qwix's quantized-training dot_general: it quantizes both
operands with absmax scales (per token for activations, per output channel or per tile for weights),
multiplies the integer or fp8 values and rescales, and its custom gradient either reuses the
unquantized operands (straight-through) or quantizes the incoming gradient too. LSQ int4, fp8 with
delayed scaling and LLM.int8() are ours (quant/lsq.py, quant/fp8.py, quant/llm_int8.py): Qwix
has no learned step sizes, no amax history, no outlier decomposition.

Qwix's public entry point (`QtProvider` + `quantize_model`) intercepts every dot_general of a
model and decides which operand is a weight by finding it among the module's parameters; after
Dense casts the kernel to the compute dtype it is no longer found, and a mode chosen by config is
simpler to pass explicitly. So the product calls Qwix's QT dot_general (`qwix._src`, pinned at
qwix==0.1.8 in requirements.txt) with a config built from the recipe.

`layer_state` is the Dense's own quantization parameter where the recipe has one: LSQ step sizes
[*out], or the fp8 amax history [3, H].
"""
import functools

import jax
import jax.numpy as jnp
from jax.experimental.layout import Layout, with_layout_constraint

from quant import lsq
from quant.contraction import dense_dims, dense_product
from quant.fp8 import fp8_delayed_dot
from quant.llm_int8 import llm_int8_dot
from quant.recipe import MatmulRecipe

try:   # the one private import of the project (see the docstring), pinned and refused in one line
  from qwix._src.core.dot_general_qt import DotGeneralQtConfig, dot_general_qt
except ImportError as e:
  raise ImportError(f'quant/matmul.py calls Qwix 0.1.8\'s quantized-training dot_general '
                    f'(qwix._src.core.dot_general_qt), which the installed qwix does not have ({e}); '
                    f'install qwix==0.1.8 as requirements.txt pins it') from None


def _plain(x, kernel, n_in, recipe, layer_state, rows_split=False):
  return dense_product(x, kernel, n_in, rows_split=rows_split)


def _qwix(config_for):
  def dot(x, kernel, n_in, recipe, layer_state):
    return dot_general_qt(x, kernel, dense_dims(x, n_in), config_for(recipe))
  return dot


def _int8_config(r: MatmulRecipe) -> DotGeneralQtConfig:
  grads = 'int8' if r.int8_backward else None
  return DotGeneralQtConfig(lhs_qtype='int8', rhs_qtype='int8', tile_size=r.block_size or None,
                            dlhs_grad_qtype=grads, drhs_grad_qtype=grads,
                            use_original_residuals=not r.int8_backward)


def _int4_config(r: MatmulRecipe) -> DotGeneralQtConfig:
  # Weight-only: activations stay in the compute dtype; the gradient is straight-through.
  return DotGeneralQtConfig(rhs_qtype='int4', tile_size=r.block_size or None,
                            use_original_residuals=True)


def _fp8_config(r: MatmulRecipe) -> DotGeneralQtConfig:
  # e4m3 (more mantissa) for the forward operands, e5m2 (more range) for gradients: the FP8 paper's split.
  return DotGeneralQtConfig(lhs_qtype=jnp.float8_e4m3fn, rhs_qtype=jnp.float8_e4m3fn,
                            tile_size=r.block_size or None, dlhs_grad_qtype=jnp.float8_e5m2,
                            drhs_grad_qtype=jnp.float8_e5m2)


def _int4_learned(x, kernel, n_in, recipe, layer_state, rows_split=False):
  return _plain(x, lsq.fake_quantize(kernel, layer_state, n_in, bits=4), n_in, recipe, None,
                rows_split)


def _fp8_delayed(x, kernel, n_in, recipe, layer_state):
  return fp8_delayed_dot(x, kernel, layer_state, n_in)


def _llm_int8(x, kernel, n_in, recipe, layer_state):
  return llm_int8_dot(x, kernel, n_in, threshold=recipe.threshold, compute_dtype=x.dtype)


_PRODUCTS = {
    'none': _plain,
    'int8': _qwix(_int8_config),
    'int4': _qwix(_int4_config),
    'fp8': _qwix(_fp8_config),
    'llm_int8': _llm_int8,
    'int4_learned': _int4_learned,
    'fp8_delayed': _fp8_delayed,
}


# The products that reshape x's leading dims into rows, and keep them instead where asked
# (`dense_product`'s `rows_split`); Qwix's keep them anyway; fp8_delayed's and llm_int8's reshape.
_KEEP_ROWS = {'none', 'int4_learned'}


# The products whose matmul takes the kernel quantized (8-bit or int4 values).
_QUANTIZED_KERNEL = {'int8', 'int4', 'fp8', 'fp8_delayed', 'llm_int8'}


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _contraction_minor(kernel: jax.Array, n_in: int) -> jax.Array:
  """One layer's kernel in the compute dtype, transposed here to contraction dims minor, the
  layout XLA:GPU gives a quantized matmul's operand. Left free, layout assignment carries that
  layout back through the layer scan's slice to the stacked fp32 parameter, and the step starts by
  transposing every layer's fp32 weights into a copy held to its end (1b: 2.25 of the 3.6 GiB
  stacks live at the peak, ZeRO-2 on 8 H100s 10.28 -> 8.31 GiB without them). Pinned to the
  stored layout first, the transpose is of one layer's 16-bit kernel, in the loop. The gradient
  passes as it is: it is not quantized and takes any layout.

  Only where the kernel is whole on each device: XLA's partitioner runs a layout constraint (a
  custom call) on the whole array, so a split kernel would be gathered in 16 bits in front of it
  (ZeRO-3 gathers the quantized values, 1b int8 on 8 H100s: 4.84 -> 6.66 GiB a step; under
  tensor parallelism a kernel is gathered that is not otherwise)."""
  stored = with_layout_constraint(kernel, Layout(tuple(range(kernel.ndim))))
  order = tuple(range(n_in, kernel.ndim)) + tuple(range(n_in))
  return with_layout_constraint(stored, Layout(order))


_contraction_minor.defvjp(lambda kernel, n_in: (_contraction_minor(kernel, n_in), None),
                          lambda n_in, _, g: (g,))


def quantized_dot(x: jax.Array, kernel: jax.Array, n_in: int, recipe: MatmulRecipe,
                  layer_state: jax.Array | None = None, out_dtype=None,
                  round_gradient: bool = False, rows_split: bool = False,
                  kernel_whole: bool = False) -> jax.Array:
  """x [..., *in] @ kernel [*in, *out] under `recipe`. `out_dtype` (None: x's): an unquantized
  product accumulates into it and is never rounded to x's dtype (the head's fp32 logits; with
  `round_gradient` its backward runs on x's dtype: `dense_product`); a quantized one is cast to it.
  `rows_split`: x's leading dims split over two mesh axes (`dense_product`). `kernel_whole`: each
  device holds the kernel whole as stored (models/hints.py:weights_whole), where a quantized
  product transposes it layer by layer on a GPU (`_contraction_minor`)."""
  if out_dtype is not None and recipe.product == 'none':
    return dense_product(x, kernel, n_in, out_dtype, round_gradient)
  if kernel_whole and recipe.product in _QUANTIZED_KERNEL:
    kernel = jax.lax.platform_dependent(kernel, cuda=lambda k: _contraction_minor(k, n_in),
                                        default=lambda k: k)
  product = _PRODUCTS[recipe.product]
  if rows_split and recipe.product in _KEEP_ROWS:
    product = functools.partial(product, rows_split=True)
  y = product(x, kernel, n_in, recipe, layer_state)
  return y if out_dtype is None else y.astype(out_dtype)
