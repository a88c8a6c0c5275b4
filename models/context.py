"""Context parallelism: the sequence split over the mesh axes that the rules give `length`.

Causal attention makes late positions costlier than early ones (a query attends to every key
before it), so contiguous pieces of the sequence would leave the first shard idle while the last
one works. The model therefore stores a row in *zigzag* order: the sequence is cut into 2C chunks
and shard r holds chunks r and 2C-1-r, one from the front and one from the back, so every shard
attends to (2C+1)/2 chunks' worth of keys per query chunk on average (Megatron-LM's and
torchtitan's load balance). The order is applied once to the inputs (tokens, targets, positions,
segment ids) and undone on outputs that keep positions (logits, per-token losses). Everything but
attention is position by position and does not notice.

Attention all-gathers the keys and values over the context axis (only the KV heads: grouped-query
attention sends num_kv_heads, not num_heads), puts them back in sequence order, and runs the
blockwise flash kernel of the shard's query blocks against them, skipping every key block after a
query block (models/attention.py:flash_attention_at). Its backward pass reduce-scatters the keys'
and values' gradients back to their shards (the all-gather's transpose). Per layer a device holds
the whole sequence's keys and values only while the layer runs: with remat `full` that is one
layer's [t, kv_heads, head_dim] pair, not the [t, t] scores, which never exist.
"""
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import flash_attention_at, flash_block
from models.hints import mesh_spec, shards


def sequence_shards() -> int:
  """Into how many context shards the rules in context split a sequence (1: none)."""
  return shards('length')


def zigzag_order(length: int, shards: int) -> np.ndarray:
  """Storage index -> sequence position: shard r's slice holds chunks r and 2 * shards - 1 - r of
  2 * shards equal chunks (the identity for one shard)."""
  chunk = length // (2 * shards)
  chunks = [c for r in range(shards) for c in (r, 2 * shards - 1 - r)]
  return np.concatenate([np.arange(c * chunk, (c + 1) * chunk) for c in chunks])


def to_zigzag(x: jax.Array | None, order: np.ndarray | None) -> jax.Array | None:
  """x [rows, length, ...] in zigzag order (x itself without an order)."""
  if x is None or order is None:
    return x
  return jnp.take(x, order, axis=1)


def from_zigzag(x: jax.Array, order: np.ndarray | None) -> jax.Array:
  """x [rows, length, ...] from zigzag back to sequence order."""
  return x if order is None else jnp.take(x, np.argsort(order), axis=1)


def _sequence_order(x: jax.Array, shards: int) -> jax.Array:
  """x [b, length, ...] gathered in zigzag order -> sequence order: each shard's front chunks in
  shard order, then its back chunks in reverse shard order."""
  b, t = x.shape[:2]
  pairs = x.reshape(b, shards, 2, t // (2 * shards), *x.shape[2:])
  front, back = pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)
  return jnp.concatenate([front, back], axis=1).reshape(x.shape)


def block_size(chunk: int) -> int:
  """Flash block for chunks of `chunk` positions: the backend's, or the largest that divides the
  chunk (a query block must not straddle two chunks)."""
  return math.gcd(chunk, flash_block())


def context_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                      segments: jax.Array | None, shards: int) -> jax.Array:
  """Causal attention of q [b, t, heads, d] with k, v [b, t, kv_heads, d] (and segment ids
  [b, t] or None), all in zigzag order with `length` split into `shards` by the rules in context;
  returns the output in the same order and split."""
  q_spec = mesh_spec(('batch', 'length', 'heads', None))
  kv_spec = mesh_spec(('batch', 'length', 'kv_heads', None))
  row_spec = mesh_spec(('batch', 'length'))
  axis = q_spec[1]
  t = q.shape[1]
  chunk = t // (2 * shards)
  block = block_size(chunk)
  per_chunk = chunk // block

  def local(q, k, v, *segments):
    r = jax.lax.axis_index(axis)
    within = jnp.arange(per_chunk)
    at = jnp.concatenate([r * per_chunk + within, (2 * shards - 1 - r) * per_chunk + within])
    gather = lambda x: _sequence_order(jax.lax.all_gather(x, axis, axis=1, tiled=True), shards)
    key_segments = [gather(s) for s in segments]
    return flash_attention_at(q, gather(k), gather(v), at, block, *segments, *key_segments)

  args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
  if segments is not None:
    args, specs = args + (segments,), specs + (row_spec,)
  return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)
