"""Context parallelism: the sequence split over the mesh axes that the rules give `length`.

Causal attention makes late positions costlier than early ones (a query attends to every key
before it), so contiguous pieces of the sequence would leave the first shard idle while the last
one works. The model therefore stores a row in *zigzag* order: the sequence is cut into 2C chunks
and shard r holds chunks r and 2C-1-r, one from the front and one from the back, so every shard
attends to (2C+1)/2 chunks' worth of keys per query chunk on average (Megatron-LM's and
torchtitan's load balance). The order is applied once to the inputs (tokens, targets, positions,
segment ids) and undone on outputs that keep positions (logits, per-token losses). Everything but
attention is position by position and does not notice.

Attention (`model.context_attention`) moves only the KV heads (grouped-query attention sends
num_kv_heads, not num_heads), two ways:
- `gather`: all-gathers the keys and values over the context axis, puts them back in sequence
  order, and runs the blockwise flash kernel of the shard's query blocks against them, skipping
  every key block after a query block (models/attention.py:flash_attention_at). Its backward pass
  reduce-scatters the keys' and values' gradients back to their shards (the all-gather's
  transpose). A device holds the whole sequence's keys and values while a layer runs (one layer's
  [t, kv_heads, head_dim] pair under remat `full`), never the [t, t] scores.
- `ring` (`ring_attention`): the keys and values pass from shard to shard, one step per shard,
  each transfer issued ahead of the step's blocks; a device holds at most two shards' of them.
"""
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from models.attention import (_MASKED, _blocked_keys, _blocked_queries, _blocked_segments,
                              _flash_backward, _flash_forward, _groups, flash_attention_at,
                              flash_block)
from models.hints import mesh_spec, shards

CONTEXT_ATTENTIONS = ('gather', 'ring')


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
                      segments: jax.Array | None, shards: int, method: str = 'gather') -> jax.Array:
  """Causal attention of q [b, t, heads, d] with k, v [b, t, kv_heads, d] (and segment ids
  [b, t] or None), all in zigzag order with `length` split into `shards` by the rules in context;
  returns the output in the same order and split. `method`: `gather` (every shard gathers all keys
  and values) or `ring` (`ring_attention`)."""
  q_spec = mesh_spec(('batch', 'length', 'heads', None))
  kv_spec = mesh_spec(('batch', 'length', 'kv_heads', None))
  row_spec = mesh_spec(('batch', 'length'))
  axis = q_spec[1]
  t = q.shape[1]
  chunk = t // (2 * shards)
  block = block_size(chunk)
  per_chunk = chunk // block

  def local(q, k, v, *segments):
    at = _shard_blocks(jax.lax.axis_index(axis), shards, per_chunk)
    if method == 'ring':
      return ring_attention(q, k, v, segments[0] if segments else None, at, axis, shards, block)
    gather = lambda x: _sequence_order(jax.lax.all_gather(x, axis, axis=1, tiled=True), shards)
    key_segments = [gather(s) for s in segments]
    return flash_attention_at(q, gather(k), gather(v), at, block, *segments, *key_segments)

  args, specs = (q, k, v), (q_spec, kv_spec, kv_spec)
  if segments is not None:
    args, specs = args + (segments,), specs + (row_spec,)
  return jax.shard_map(local, in_specs=specs, out_specs=q_spec, check_vma=False)(*args)


def _shard_blocks(r: jax.Array, shards: int, per_chunk: int) -> jax.Array:
  """The blocks of the sequence that shard r holds, in its order: chunk r's, then chunk
  2 * shards - 1 - r's."""
  within = jnp.arange(per_chunk)
  return jnp.concatenate([r * per_chunk + within, (2 * shards - 1 - r) * per_chunk + within])


# ---- ring: keys and values passed around the context axis --------------------------------------
# Each shard keeps its own keys and values and passes them one shard on at every step (a
# collective-permute issued before the step's blocks are computed, so that on a GPU the transfer
# can run under them); after `shards` steps every query block has met every key block. A step's
# partial outputs are merged by their log-sum-exp as the flash kernel merges blocks. The backward
# pass passes the keys and values around again, with their gradients travelling beside them, so
# that after the last step each shard holds its own blocks' dk and dv: no shard ever holds more
# than two shards' keys and values (the ones it computes with and the ones arriving).

def ring_attention(q, k, v, segments, at, axis, shards: int, block: int) -> jax.Array:
  """One shard's causal attention over the ring: q [b, n, heads, d] and k, v [b, n, kv_heads, d]
  the shard's, its blocks at `at` of the sequence (every shard's keys lie at its own `at`)."""
  b, n, heads, d = q.shape
  kv_heads, blocks = k.shape[2], n // block
  qb = _blocked_queries(_groups(q, kv_heads), blocks, block)
  kb, vb = (_blocked_keys(x, blocks, block) for x in (k, v))
  sb = _blocked_segments(segments, blocks, block)
  out = _ring_blocked(qb, kb, vb, sb, at, axis, shards)
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, n, heads, d)


def _ring_step(axis, shards: int, *blocks):
  """`blocks` passed one shard on (shard i's to shard i + 1)."""
  return jax.lax.ppermute(blocks, axis, [(i, (i + 1) % shards) for i in range(shards)])


def _key_blocks(at: jax.Array, step, axis, shards: int) -> jax.Array:
  """Where the keys a shard holds at ring step `step` lie: those of shard r - step."""
  per_chunk = at.shape[0] // 2
  return _shard_blocks((jax.lax.axis_index(axis) - step) % shards, shards, per_chunk)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _ring_blocked(qb, kb, vb, sb, at, axis, shards):
  return _ring_forward(qb, kb, vb, sb, at, axis, shards)[0]


def _ring_forward(qb, kb, vb, sb, at, axis, shards):
  def attend(s, kb, vb, ksb, out, lse):
    """The step's partial result merged into the running one by their log-sum-exps."""
    part, part_lse = _flash_forward(qb, kb, vb, sb, ksb, at, _key_blocks(at, s, axis, shards))
    merged = jnp.logaddexp(lse, part_lse)
    return (out * jnp.exp(lse - merged)[..., None] + part * jnp.exp(part_lse - merged)[..., None],
            merged)

  def step(s, carry):
    kb, vb, ksb, out, lse = carry
    arriving = _ring_step(axis, shards, kb, vb, ksb)
    return (*arriving, *attend(s, kb, vb, ksb, out, lse))

  lse = jnp.full(qb.shape[:-1], _MASKED, jnp.float32)
  init = (kb, vb, sb, jnp.zeros(qb.shape, jnp.float32), lse)
  # The last step's keys need not move on.
  out, lse = attend(shards - 1, *jax.lax.fori_loop(0, shards - 1, step, init))
  return out.astype(qb.dtype), lse


def _ring_blocked_fwd(qb, kb, vb, sb, at, axis, shards):
  out, lse = _ring_forward(qb, kb, vb, sb, at, axis, shards)
  return out, (qb, kb, vb, sb, at, out, lse)


def _ring_blocked_bwd(axis, shards, residuals, d_out):
  qb, kb, vb, sb, at, out, lse = residuals

  def step(s, carry):
    kb, vb, ksb, dk, dv, dq = carry
    dq_part, dk_part, dv_part = _flash_backward(qb, kb, vb, sb, ksb, at, out, lse, d_out,
                                                _key_blocks(at, s, axis, shards))
    kb, vb, ksb, dk, dv = _ring_step(axis, shards, kb, vb, ksb, dk + dk_part, dv + dv_part)
    return kb, vb, ksb, dk, dv, dq + dq_part

  zeros = lambda x: jnp.zeros(x.shape, jnp.float32)
  init = (kb, vb, sb, zeros(kb), zeros(vb), zeros(qb))
  *_, dk, dv, dq = jax.lax.fori_loop(0, shards, step, init)
  no_grad = lambda x: None if x is None else np.zeros(x.shape, jax.dtypes.float0)
  return (dq.astype(qb.dtype), dk.astype(kb.dtype), dv.astype(vb.dtype), no_grad(sb), no_grad(at))


_ring_blocked.defvjp(_ring_blocked_fwd, _ring_blocked_bwd)
