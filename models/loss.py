"""Next-token cross-entropy from the final hidden states, the head's matmul included.

With `chunk` > 0 the head and the log-softmax run `chunk` positions at a time, in a scan whose body
is rematerialised: the forward pass keeps only each chunk's loss, the backward pass recomputes the
chunk's logits, takes their gradient and drops both before the next chunk. The fp32
[batch, length, vocab] logits and their gradient (at a 128k vocabulary, ~1 GiB each per 2k tokens)
never exist; one chunk's do. The losses equal the unchunked ones: each position's loss depends only
on its own logits.
"""
from typing import Callable

import jax
import jax.numpy as jnp
import optax


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
  if chunk <= 0 or chunk >= t:
    return losses(x, targets)
  n = -(-t // chunk)
  pad = n * chunk - t   # padded positions' losses are computed and cut off
  x = jnp.pad(x, ((0, 0), (0, pad), (0, 0)))
  targets = jnp.pad(targets, ((0, 0), (0, pad)))
  # [n, batch, chunk, ...]: the scan runs over chunks of positions; the batch keeps its sharding.
  xs = x.reshape(b, n, chunk, x.shape[-1]).swapaxes(0, 1)
  ts = targets.reshape(b, n, chunk).swapaxes(0, 1)
  one_chunk = jax.checkpoint(losses, prevent_cse=False)
  _, per_chunk = jax.lax.scan(lambda _, xt: (None, one_chunk(*xt)), None, (xs, ts))
  return per_chunk.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]
