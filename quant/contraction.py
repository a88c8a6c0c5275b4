"""The one contraction every dense product computes: x [..., *in] @ kernel [*in, *out].

`dense_product` runs it as one 2-D matmul, [rows, in] @ [in, out], forward and backward (its own
VJP, between free reshapes). XLA:CPU compiles a dot_general whose operands keep their [batch,
length, ...] dims into a backward whose weight gradient contracts two dims, and lays it out by
transposing the large output gradient inside the elementwise fusion that produces it (issue 29:
the issue-shape train step 1.4x faster without). On the CPU the weight gradient is taken from an
explicit transposed copy of the input, so that XLA does not transpose the output gradient instead;
other backends get autodiff's own products (a GPU's GEMMs read either orientation, so a copy there
would only add traffic).

`wide_product` is the head's: 16-bit operands into fp32 logits, whose backward takes the logits'
gradient in the operands' dtype.
"""
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

# The name of a dense product's output, for the remat policies.
DENSE_OUTPUT = 'dense_output'


def dense_dims(x: jax.Array, n_in: int) -> jax.lax.DotDimensionNumbers:
  """`dot_general` dimension numbers contracting the last `n_in` dims of x with the first of the
  kernel (several input dims, e.g. [heads, head_dim] -> [embed], need no reshape)."""
  return ((tuple(range(x.ndim - n_in, x.ndim)), tuple(range(n_in))), ((), ()))


def dense_product(x: jax.Array, kernel: jax.Array, n_in: int, out_dtype=None,
                  round_gradient: bool = False, rows_split: bool = False) -> jax.Array:
  """x [..., *in] @ kernel [*in, *out] -> [..., *out], as a 2-D matmul forward and backward.
  `out_dtype`: accumulate into this dtype instead of x's (the head's fp32 logits), differentiated
  by autodiff's own products, which keep the fp32 gradient's precision, or with
  `round_gradient` by `wide_product`'s, on x's dtype. `rows_split`: x's leading dims are split
  over two mesh axes (the batch over the data-parallel ones, the sequence over `context`), which
  their 2-D reshape cannot keep where a device holds more than one row: XLA would gather the
  sequence on every device (7b at 128k tokens, 2 rows a device on 8 H100s: 111 GiB a device, 97
  with the dims kept, and each device computing its context peers' tokens); the product keeps
  them as they are."""
  if out_dtype is not None and round_gradient:
    return wide_product(x, kernel, dense_dims(x, n_in)).astype(out_dtype)
  if out_dtype is not None or x.dtype != kernel.dtype:
    return jax.lax.dot_general(x, kernel, dense_dims(x, n_in), preferred_element_type=out_dtype)
  if rows_split:
    return checkpoint_name(jax.lax.dot_general(x, kernel, dense_dims(x, n_in)), DENSE_OUTPUT)
  # Named, because a remat policy cannot see the matmul inside the custom VJP: `dots` saves by
  # this name what it saves of a plain dot_general (models/llama.py).
  return checkpoint_name(_dense_2d(x, kernel, n_in), DENSE_OUTPUT)


def _as_matrices(x: jax.Array, kernel: jax.Array, n_in: int):
  inner = math.prod(kernel.shape[:n_in])
  return x.reshape(-1, inner), kernel.reshape(inner, -1)


# The residuals are x and the kernel as they came in (not their 2-D reshapes): inside the layer
# scan a reshape is a value of its own, and the scan would stack it beside the input that other
# operations (the norm's backward) keep, twice the activations' memory.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _dense_2d(x: jax.Array, kernel: jax.Array, n_in: int) -> jax.Array:
  rows, matrix = _as_matrices(x, kernel, n_in)
  return (rows @ matrix).reshape(*x.shape[:x.ndim - n_in], *kernel.shape[n_in:])


def _dense_2d_forward(x, kernel, n_in):
  return _dense_2d(x, kernel, n_in), (x, kernel)


def _dense_2d_backward(n_in, residuals, g):
  x, kernel = residuals
  rows, matrix = _as_matrices(x, kernel, n_in)
  g = g.reshape(rows.shape[0], matrix.shape[1])
  # On XLA:CPU, a copy of x's transpose of its own ([in, rows]): without the barrier XLA folds the
  # transpose into the dot and lays out the output gradient transposed instead, inside the
  # elementwise fusion that produces it. Chosen by the platform the step is lowered for (a GPU
  # target compiled on a CPU gets the GPU's program).
  rows_t = jax.lax.platform_dependent(rows.T, cpu=jax.lax.optimization_barrier,
                                      default=lambda t: t)
  return (g @ matrix.T).reshape(x.shape), (rows_t @ g).reshape(kernel.shape)


_dense_2d.defvjp(_dense_2d_forward, _dense_2d_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def wide_product(x: jax.Array, kernel: jax.Array, dims) -> jax.Array:
  """`dot_general(x, kernel, dims)` of two 16-bit operands accumulated into fp32 and not rounded
  (logits: a bf16 logit has 8 significant bits). Its backward rounds the fp32 gradient to x's dtype
  before its two products, so that they too run on 16-bit operands with fp32 accumulation, as
  under PyTorch's autocast (whose logits are 16-bit, upcast for the loss). Differentiated as a
  plain product, the fp32 gradient makes both fp32 GEMMs: on a GPU, TF32 at best (19 % of the 1b
  step on an H200, issue 47)."""
  return jax.lax.dot_general(x, kernel, dims, preferred_element_type=jnp.float32)


def _wide_forward(x, kernel, dims):
  return wide_product(x, kernel, dims), (x, kernel)


def _wide_backward(dims, residuals, g):
  x, kernel = residuals
  # The product in x's dtype has the same transposes, each a 16-bit GEMM accumulating in fp32 and
  # rounded to the operands' dtype, which the gradients are returned in anyway.
  _, products = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), x, kernel)
  # Both products before either gradient is used: left free, XLA:GPU schedules the kernel's after
  # the whole backward pass of the layers, which keeps the logits' gradient ([tokens, vocabulary])
  # alive through it (7b at 32k on 8 H100s, bench.buffers --target: 1.95 GiB at the layers' peak).
  return jax.lax.optimization_barrier(products(g.astype(x.dtype)))


wide_product.defvjp(_wide_forward, _wide_backward)
