"""The one dense projection every matmul in the model goes through.

Weights carry logical axis names (for sharding rules) and are stored in the policy's param dtype;
the product runs in the policy's compute dtype, through the quantized matmul its recipe names
(quant/matmul.py). Quantized modes plug in here, not in the model.
The kernel may have several input and output dimensions (e.g. `[embed] -> [heads, head_dim]`), so
tensor parallelism can split heads without reshapes in the model.
A layer may carry a bias (GPT-2) and LoRA adapters (models/lora.py); its kernel may be stored
quantized and frozen (quant/weights.py: QLoRA's base, or a post-training quantized model):
`quantize_weights` / `dequantize_weights` below swap every kernel of a model between the two.
`AdapterCall` is what a forward pass tells the adapter hook (dropout key, reference rows).
"""
import contextvars
import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.hints import shards, trace_setting, weights_gathered, weights_whole
from models.loss import head_gradient_rounded
from precision.policy import Policy
from quant import fp8, lsq
from quant.matmul import quantized_dot
from quant.weights import QuantizedKernel, QuantizedWeight, check_format


# None: the products keep their casts; else whether their recomputation must be kept from CSE.
_CASTS_RECOMPUTED = contextvars.ContextVar('weight_casts_recomputed', default=None)


def weight_casts_recomputed(prevent_cse: bool):
  """Trace-time context: the float products below cast their stored kernels to the compute
  dtype again in the backward pass instead of keeping the casts from the forward.
  `prevent_cse`: where the forward and the backward are one computation (an unrolled layer
  scan), keep XLA from merging the recomputed casts back into the forward's; in a rolled scan
  leave it off, since the barrier it adds kept XLA:GPU from merging the q, k and v weight
  gradients into one product (14 against 12 GEMMs a layer at 1b, jax 0.11.2).

  Without remat, autodiff keeps the product's operands for the backward, and for a kernel stored
  wider than it computes that is its compute-dtype copy: the 1b step without remat compiled for
  one H200 stacked every layer's bf16 weights in the forward scan (1.8 GiB), written there by
  a kernel per weight and layer, and its H200 profile had the q/k/v kernels' stack writes
  among the slowest non-matmul kernels (32 GB/s). Recomputed, the backward reads the stored
  weights, which the step holds anyway: that step 46.55 -> 44.73 GiB, 7b under ZeRO-2 in 4
  microbatches on 8 A100s 62.11 -> 50.09 GiB (compiled for the GPUs, bench.buffers --target).
  Not where the weights are gathered (ZeRO-3): the backward gathers them again anyway, and
  recomputed there the cast followed the gather (1b on 8 H100s +0.4 GiB)."""
  return trace_setting(_CASTS_RECOMPUTED, prevent_cse)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class AdapterCall:
  """What one forward pass tells the adapters: a dropout key (None: no dropout, as in evaluation)
  and, for a pass with reference rows, a [batch] mask that is 1 where the adapters are on."""
  dropout_key: jax.Array | None = None
  active_rows: jax.Array | None = None

  def for_layer(self, key: jax.Array | None) -> 'AdapterCall':
    return dataclasses.replace(self, dropout_key=key)


def logical_param(value: jax.Array, axes: Sequence[str]) -> nnx.Param:
  """A parameter annotated with logical axis names; the mesh placement is decided later by rules."""
  # eager_sharding=False: the model is built without a mesh; train/ places it with jit out_shardings.
  return nnx.Param(value, out_sharding=tuple(axes), eager_sharding=False)


def _as_tuple(x) -> tuple[int, ...]:
  return tuple(x) if isinstance(x, Sequence) else (int(x),)


class Dense(nnx.Module):
  """y = x @ W over the trailing `in_features` dims of x; W is `in_features + out_features`."""

  def __init__(self, in_features, out_features, *, axes: tuple[str, ...], policy: Policy,
               rngs: nnx.Rngs, init_std: float, use_bias: bool = False, out_dtype=None):
    """`out_dtype`: the output's dtype when it is not the compute dtype (the head: fp32 logits,
    accumulated in fp32 and never rounded to the compute dtype)."""
    self.in_features = _as_tuple(in_features)
    self.out_features = _as_tuple(out_features)
    shape = self.in_features + self.out_features
    if len(axes) != len(shape):
      raise ValueError(f'axes {axes} do not name every kernel dimension {shape}')
    self.policy = policy
    self.out_dtype = out_dtype
    self.axes = tuple(axes)   # one layer's logical axes (a stacked kernel adds `layers` in front)
    self.init_std = init_std  # what a random frozen base draws this kernel with (train/init_from.py)
    kernel = jax.nn.initializers.normal(init_std)(rngs.params(), shape, policy.param_dtype)
    self.kernel = logical_param(kernel, axes)
    n_in = len(self.in_features)
    self.bias = (logical_param(jax.numpy.zeros(self.out_features, policy.param_dtype), axes[n_in:])
                 if use_bias else None)
    self.lora = nnx.data(None)   # LoRA adapters, attached by path while the model is built (models/lora.py)
    # LSQ: one learned int4 step size per output channel, sharded like the kernel's outputs.
    self.step_size = (logical_param(lsq.initial_step_size(kernel, n_in, bits=4), axes[n_in:])
                      if policy.matmul.learned_scale else None)
    # fp8 delayed scaling: the amax history of (x, kernel, gradient), a parameter updated by the step.
    self.amax_history = (fp8.new_history(policy.matmul.amax_history)
                         if policy.matmul.delayed_scaling else None)

  def kernel_axes(self) -> tuple:
    """The kernel's logical axes as stored (with `layers` in front when stacked)."""
    if isinstance(self.kernel, QuantizedKernel):
      return self.kernel.axes
    return tuple(self.kernel.get_metadata()['out_sharding'])

  def __call__(self, x: jax.Array, adapters: AdapterCall | None = None) -> jax.Array:
    dtype = self.policy.compute_dtype
    layer_state = next((v[...] for v in (self.step_size, self.amax_history) if v is not None), None)
    x = x.astype(dtype)
    n_in = len(self.in_features)
    # Sequences whose length is split over `context`: the product keeps x's leading dims rather
    # than flattening them into rows (quant/contraction.py).
    rows_split = x.ndim - n_in > 1 and shards('length') > 1

    def product(x, kernel):
      return quantized_dot(x, kernel, n_in, self.policy.matmul, layer_state, self.out_dtype,
                           self.out_dtype is not None and head_gradient_rounded(dtype), rows_split,
                           kernel_whole=weights_whole(self.axes))

    if isinstance(self.kernel, QuantizedKernel):   # weight-only quantized storage (quant/weights.py)
      y = product(x, self.kernel.dequantize(dtype))
    elif (_CASTS_RECOMPUTED.get() is not None and self.policy.matmul.product == 'none'
          and jnp.dtype(self.kernel.dtype).itemsize > jnp.dtype(dtype).itemsize
          and not weights_gathered()):
      cast_product = lambda x, stored: product(x, stored.astype(dtype))
      y = jax.checkpoint(cast_product, policy=jax.checkpoint_policies.nothing_saveable,
                         prevent_cse=_CASTS_RECOMPUTED.get())(x, self.kernel[...])
    else:
      y = product(x, self.kernel[...].astype(dtype))
    if self.bias is not None:
      y = y + self.bias[...].astype(y.dtype)
    if self.lora is not None:
      y = y + self.lora(x, adapters)
    return y


def learned_grid_kernel(dense: Dense) -> jax.Array:
  """The float kernel a forward pass multiplies by: with LSQ step sizes, the kernel on their grid
  (per layer where stacked); otherwise the kernel as stored."""
  kernel = dense.kernel[...]
  if dense.step_size is None:
    return kernel
  n_in = len(dense.in_features)
  grid = lambda k, s: lsq.fake_quantize(k, s, n_in, bits=4)
  if kernel.ndim > n_in + len(dense.out_features):
    grid = jax.vmap(grid)
  return grid(kernel, dense.step_size[...])


def quantize_weights(model: nnx.Module, fmt: str) -> nnx.Module:
  """Replaces, in place, every float Dense kernel of `model` by its quantized storage. A kernel
  trained with LSQ step sizes is stored on their grid (exactly, in int4; quant/weights.py)."""
  check_format(fmt)
  denses = [m for _, m in nnx.iter_modules(model) if isinstance(m, Dense)
            and not isinstance(m.kernel, QuantizedKernel)]
  for dense in denses:
    kernel = learned_grid_kernel(dense)
    n_in = len(dense.in_features)
    stacked = kernel.ndim > n_in + len(dense.out_features)
    steps = None if dense.step_size is None else dense.step_size[...]
    dense.kernel = QuantizedKernel(kernel, fmt, n_in, stacked, axes=dense.kernel_axes(),
                                   steps=steps)
  return model


def bake_learned_grid(model: nnx.Module) -> nnx.Module:
  """Replaces, in place, every LSQ kernel by its values on the learned grid, and drops the step
  sizes: a float model that computes what the trained one did (for export)."""
  for _, dense in nnx.iter_modules(model):
    if isinstance(dense, Dense) and dense.step_size is not None:
      dense.kernel = nnx.Param(learned_grid_kernel(dense), out_sharding=dense.kernel_axes(),
                               eager_sharding=False)
      dense.step_size = None
  return model


def dequantize_weights(model: nnx.Module, dtype=jnp.float32) -> nnx.Module:
  """The inverse, in place: every quantized kernel back to a float parameter (for export)."""
  for _, dense in nnx.iter_modules(model):
    if isinstance(dense, Dense) and isinstance(dense.kernel, QuantizedKernel):
      axes = dense.kernel.axes
      dense.kernel = nnx.Param(dense.kernel.dequantize_all(dtype), out_sharding=axes,
                               eager_sharding=False)
  return model


def stored_bytes(model: nnx.Module) -> dict[str, int]:
  """Bytes held by the model: float parameters and quantized weights."""
  def total(kind):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(nnx.state(model, kind)))
  return {'params': total(nnx.Param), 'quantized': total(QuantizedWeight)}
