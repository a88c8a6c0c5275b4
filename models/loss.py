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

from models.hints import shards


@jax.custom_vjp
def logits_16bit_gradient(x: jax.Array, table: jax.Array) -> jax.Array:
  """fp32 logits [batch, n, vocab] of hidden states `x` [batch, n, d_model] against `table`
  [vocab, d_model], both in the compute dtype: the product accumulates in fp32 and the logits are
  not rounded. Its backward rounds the logits' gradient to the compute dtype first, so that both of
  its products run on 16-bit operands with fp32 accumulation, as under PyTorch's autocast (whose
  logits are 16-bit, upcast for the loss). Differentiated as a plain product, the fp32 gradient
  makes both products fp32 GEMMs: on a GPU, TF32 at best (19 % of the 1b step on an H200)."""
  return jnp.einsum('bld,vd->blv', x, table, preferred_element_type=jnp.float32)


def _logits_forward(x, table):
  return logits_16bit_gradient(x, table), (x, table)


def _logits_backward(saved, g):
  x, table = saved
  g = g.astype(x.dtype)
  dx = jnp.einsum('blv,vd->bld', g, table, preferred_element_type=jnp.float32)
  dtable = jnp.einsum('blv,bld->vd', g, x, preferred_element_type=jnp.float32)
  return dx.astype(x.dtype), dtable.astype(table.dtype)


logits_16bit_gradient.defvjp(_logits_forward, _logits_backward)


@jax.named_scope('loss')
def token_losses(head: Callable[[jax.Array], jax.Array], x: jax.Array, targets: jax.Array,
                 chunk: int = 0) -> jax.Array:
  """Losses [batch, length] in nats of `head(x)` (fp32 logits [batch, n, vocab] from hidden
  states [batch, n, d_model]) against integer `targets` [batch, length]; a target < 0 is not
  predicted (padding, or the next document's first token): its loss is 0, and so is its gradient."""
  def losses(x, targets):
    ignored = targets < 0
    nats = optax.softmax_cross_entropy_with_integer_labels(head(x), jnp.where(ignored, 0, targets))
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
