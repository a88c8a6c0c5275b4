"""Next-token cross-entropy from the final hidden states, the head's matmul included.

With `chunk` > 0 the head and the log-softmax run `chunk` positions at a time, in a scan whose body
is rematerialised: the forward pass keeps only each chunk's loss, the backward pass recomputes the
chunk's logits, takes their gradient and drops both before the next chunk. The fp32
[batch, length, vocab] logits and their gradient (at a 128k vocabulary, ~1 GiB each per 2k tokens)
never exist; one chunk's do (on every context shard: each runs its own positions). The losses
equal the unchunked ones: each position's loss depends only on its own logits.
"""
from typing import Callable

import jax
import jax.numpy as jnp
import optax

from models.attention import compile_platform
from models.hints import shards


def head_gradient_rounded(compute_dtype, platform: str | None = None) -> bool:
  """Whether the head's backward takes the logits' gradient in the 16-bit compute dtype
  (quant/contraction.py:wide_product) rather than autodiff's fp32: off the CPU. XLA:CPU of jax 0.10
  runs bf16 products in fp32 whatever their operands, so the CPU keeps the plain product's program
  (and every figure calibrated on it). `platform`: the one compiled for (default: the one being
  traced for), as the memory estimate asks of the backend it models."""
  return ((platform or compile_platform()) != 'cpu'
          and jnp.dtype(compute_dtype) != jnp.float32)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Nats of integer `targets` [...] under fp32 `logits` [..., vocab]. Off the CPU the target's
  logit is picked by a mask over the vocabulary rather than a gather: the gather's gradient is a
  scatter into the fp32 gradient of the logits, which must then exist whole before its cast to the
  compute dtype, where the mask's is elementwise and fuses with the softmax's and the cast (1b
  ZeRO-3 on 8 H100s, bench.buffers --target: one fp32 [tokens, vocabulary] buffer fewer at the
  head's backward). XLA:CPU keeps optax's gather, the program its figures are calibrated on,
  except inside a shard_map with manual axes (a zero-bubble pipeline's stages): XLA's partitioner
  aborts on that gather from logits split over `tensor` there (jax 0.10.2 to 0.12.0.1)."""
  if compile_platform() == 'cpu' and not jax.sharding.get_abstract_mesh().manual_axes:
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  vocab = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
  picked = jnp.sum(jnp.where(vocab == targets[..., None], logits, 0.0), axis=-1)
  return jax.nn.logsumexp(logits, axis=-1) - picked


@jax.named_scope('loss')
def token_losses(head: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                 chunk: int = 0) -> jax.Array:
  """Losses [batch, length] in nats of `head(x)` (fp32 logits [batch, n, vocab] from hidden
  states [batch, n, d_model]) against integer `targets` [batch, length]; a target < 0 is not
  predicted (padding, or the next document's first token): its loss is 0, and so is its gradient."""
  def losses(x, targets):
    ignored = targets < 0
    nats = cross_entropy(head(x), jnp.where(ignored, 0, targets))
    return jnp.where(ignored, 0.0, nats)

  b, t = targets.shape
  # Under context parallelism each shard runs its own positions' chunks (a scan over a sharded
  # axis would gather the whole sequence's hidden states onto every device).
  pieces = shards('length')
  local = t // pieces
  if chunk <= 0 or chunk >= local:
    return losses(x, targets)
  n = -(-local // chunk)
  pad = n * chunk - local   # padded positions' losses are computed and cut off

  def chunked(a):
    """[b, t, ...] -> [n, b, pieces * chunk, ...]: the scan runs over chunks of every shard's
    positions at once; the batch and the shards keep their sharding."""
    a = a.reshape(b, pieces, local, *a.shape[2:])
    a = jnp.pad(a, [(0, 0), (0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 3))
    a = jnp.moveaxis(a.reshape(b, pieces, n, chunk, *a.shape[3:]), 2, 0)
    return a.reshape(n, b, pieces * chunk, *a.shape[4:])

  one_chunk = jax.checkpoint(losses, prevent_cse=False)
  _, per_chunk = jax.lax.scan(lambda _, xt: (None, one_chunk(*xt)), None,
                              (chunked(x), chunked(targets)))
  per_chunk = per_chunk.reshape(n, b, pieces, chunk)
  return jnp.moveaxis(per_chunk, 0, 2).reshape(b, pieces, n * chunk)[:, :, :local].reshape(b, t)
