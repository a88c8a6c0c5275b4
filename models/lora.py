"""LoRA adapters (Hu et al. 2021) inside the project's dense layer: y = x W + (alpha / r) x A B.

A is [*in, r] (random), B is [r, *out] (zeros), so an adapted model starts equal to its base.
Adapters are `nnx.LoRAParam`s; the train state splits on that type: adapters are the trainable
parameters (gradients, optimizer state), everything else is the frozen base (train/state.py).

Adapters are attached by module path (a regex over paths such as `blocks/attention/query`),
while the model is being built: for the scanned blocks inside the same `nnx.vmap` that creates them,
so they are stacked on the `layers` axis like the kernels (Qwix's LoRA, attached afterwards, fails
under `nnx.scan`). A frozen base kernel may be stored quantized (QLoRA); the adapters stay in floats.

One forward pass can return the active logits and the reference (adapters off) logits together:
the batch is run twice in one stacked batch, with the adapter output masked to zero on the second
half (`AdapterCall.active_rows`, models/dense.py), so no second copy of the model exists (what
RLHF's KL term needs).
"""
import dataclasses
import math
import re
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from models.dense import AdapterCall, Dense
from quant.contraction import dense_dims
from quant.weights import QuantizedKernel

DEFAULT_TARGETS = '.*attention/(query|value)'   # the LoRA paper's choice: W_q and W_v


@dataclasses.dataclass(frozen=True)
class LoraSpec:
  rank: int
  alpha: float
  dropout: float = 0.0
  targets: str = DEFAULT_TARGETS   # re.fullmatch over module paths

  @property
  def scaling(self) -> float:
    return self.alpha / self.rank

  def matches(self, path: str) -> bool:
    return re.fullmatch(self.targets, path) is not None

  def check(self) -> None:
    if not isinstance(self.rank, int) or self.rank < 1:
      raise ValueError(f'lora.rank={self.rank!r}; it must be a positive integer (0 turns LoRA off)')
    if not self.alpha > 0:
      raise ValueError(f'lora.alpha={self.alpha!r}; it must be a positive number')
    if not 0 <= self.dropout < 1:
      raise ValueError(f'lora.dropout={self.dropout!r}; it must be in [0, 1)')
    try:
      re.compile(self.targets)
    except re.error as e:
      raise ValueError(f'lora.targets={self.targets!r} is not a regular expression ({e})') from None


class LoRA(nnx.Module):
  """The low-rank update of one dense layer, with the layer's logical axes on A's inputs and B's
  outputs (so tensor and fully-sharded layouts split the adapters like the kernel)."""

  def __init__(self, in_features: Sequence[int], out_features: Sequence[int], *,
               axes: Sequence[str], spec: LoraSpec, dtype, salt: int, rngs: nnx.Rngs):
    n_in = len(in_features)
    fan_in = math.prod(in_features)
    # Uniform A with bound sqrt(3 / fan_in) (unit-variance outputs; PEFT's bound is 1/sqrt(fan_in));
    # B = 0 makes the initial update exactly zero.
    bound = (3.0 / fan_in) ** 0.5
    a = jax.random.uniform(rngs.params(), (*in_features, spec.rank), dtype, -bound, bound)
    self.a = nnx.LoRAParam(a, out_sharding=(*axes[:n_in], None), eager_sharding=False)
    self.b = nnx.LoRAParam(jnp.zeros((spec.rank, *out_features), dtype),
                           out_sharding=(None, *axes[n_in:]), eager_sharding=False)
    self.n_in = n_in
    self.scaling = spec.scaling
    self.dropout = spec.dropout
    self.salt = salt   # tells this layer's dropout mask from the other adapted layers'

  def __call__(self, x: jax.Array, call: AdapterCall | None) -> jax.Array:
    dtype = x.dtype
    if call is not None and call.dropout_key is not None and self.dropout > 0:
      keep = jax.random.bernoulli(jax.random.fold_in(call.dropout_key, self.salt),
                                  1 - self.dropout, x.shape)
      x = jnp.where(keep, x / (1 - self.dropout), 0).astype(dtype)
    n_in = self.n_in
    h = jax.lax.dot_general(x, self.a[...].astype(dtype), dense_dims(x, n_in))
    delta = jnp.tensordot(h, self.b[...].astype(dtype), axes=1) * jnp.asarray(self.scaling, dtype)
    if call is not None and call.active_rows is not None:
      rows = call.active_rows.astype(dtype).reshape((-1,) + (1,) * (delta.ndim - 1))
      delta = delta * rows
    return delta

  def update(self) -> jax.Array:
    """scaling * A B in the kernel's shape (with a leading layers axis when stacked), fp32."""
    a, b = self.a[...].astype(jnp.float32), self.b[...].astype(jnp.float32)
    stacked = a.ndim - self.n_in - 1
    lead = a.shape[:stacked]
    a_m = a.reshape(*lead, -1, a.shape[-1])
    b_m = b.reshape(*lead, b.shape[stacked], -1)
    product = jnp.matmul(a_m, b_m) * self.scaling
    return product.reshape(*lead, *a.shape[stacked:-1], *b.shape[stacked + 1:])


def dense_paths(module: nnx.Module, prefix: str = '') -> list[tuple[str, nnx.Module]]:
  """(path, Dense) for every dense layer under `module`, paths joined with '/'."""
  out = []
  for path, sub in nnx.iter_modules(module):
    if isinstance(sub, Dense):
      out.append(('/'.join(filter(None, (prefix, *map(str, path)))), sub))
  return out


def attach(module: nnx.Module, spec: LoraSpec | None, *, prefix: str, rngs: nnx.Rngs,
           dtype) -> None:
  """Adds adapters to the dense layers of `module` whose path matches `spec.targets`."""
  if spec is None:
    return
  for salt, (path, dense) in enumerate(dense_paths(module, prefix)):
    if spec.matches(path):
      dense.lora = LoRA(dense.in_features, dense.out_features, axes=dense.axes, spec=spec,
                        dtype=dtype, salt=salt, rngs=rngs)


def check_targets(module: nnx.Module, spec: LoraSpec) -> list[str]:
  """The adapted paths; ValueError listing some module paths when the regex matches none."""
  paths = [path for path, _ in dense_paths(module)]
  matched = [p for p in paths if spec.matches(p)]
  if not matched:
    raise ValueError(f'lora.targets={spec.targets!r} matches no dense layer; the model has '
                     f'{", ".join(paths[:12])}{" ..." if len(paths) > 12 else ""}')
  return matched


def merge(module: nnx.Module, dtype=jnp.float32) -> nnx.Module:
  """Folds every adapter into its kernel (a quantized kernel is dequantized first) and removes
  it, in place: the merged model has the adapted model's outputs and no adapters. The sum is
  computed in fp32 and stored in `dtype` (an export's own), whatever the base was stored in: a
  bf16 base would otherwise round away every update below half a bf16 step."""
  for _, dense in nnx.iter_modules(module):
    if not isinstance(dense, Dense) or dense.lora is None:
      continue
    if isinstance(dense.kernel, QuantizedKernel):
      kernel = dense.kernel.dequantize_all(jnp.float32)
    else:
      kernel = dense.kernel[...]
    merged = (kernel.astype(jnp.float32) + dense.lora.update()).astype(dtype)
    dense.kernel = nnx.Param(merged, out_sharding=dense.kernel_axes(), eager_sharding=False)
    dense.lora = None
  return module
