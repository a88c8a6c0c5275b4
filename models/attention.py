"""Causal grouped-query attention, three ways (`model.attention`):

- `xla`: the scores written out as one [t, t] block per head (the reference; memory quadratic in
  the length);
- `flash`: blockwise attention with an online softmax (FlashAttention-2's algorithm) written in
  JAX, with its own backward pass that recomputes each block from the saved log-sum-exp: no
  [t, t] block ever exists, forward or backward, so memory grows linearly with the length. It runs
  on any backend, so the CPU's dry runs and tests see the memory a GPU run will have;
- `cudnn`: `jax.nn.dot_product_attention`'s cuDNN fused kernel (GPU, bf16/fp16 only).

`auto` picks `cudnn` on a GPU in 16-bit compute and `flash` everywhere else: on the platform the
step is compiled for (`compiling_for`: a GPU target compiled on a CPU is a GPU's step), by default
JAX's backend.

All take q [b, t, heads, d] and k, v [b, t, kv_heads, d]; query head h reads KV head
h // (heads / kv_heads). Packed rows (several documents in one row) pass `segments` [b, t] int, a
document id per position: query i then sees key j iff j <= i and both are in the same segment.
Without segments each implementation is the plain causal one (no segment mask is built).

The products accumulate in fp32 and the scores stay in fp32 through the scaling by 1/sqrt(d) and
the softmax: nothing between the product and the softmax is rounded to the compute dtype (scaling q
first would round q * 1/sqrt(d), inexact unless d is a power of 4). The probabilities are rounded
to the compute dtype only as an operand of the product with v.
"""
import contextvars

import jax
import jax.numpy as jnp
import numpy as np

from models.hints import trace_setting

ATTENTIONS = ('auto', 'xla', 'flash', 'cudnn')
# Query and key positions per flash block. On an accelerator 512 keeps a block's fp32 scores at
# 1 MiB per head: small beside the layer's other buffers at any length, and long enough that the
# loop overhead is paid once per 512 x 512 products. On a CPU 64: a block pair's scores (16 KiB per
# head) stay in the core's caches, and a causal row skips more of the products above the diagonal
# (issue 29: fwd+bwd of 8 x 256 tokens, 4 heads of 64, 37 ms per layer at 512, 22 ms at 64, 27 ms at
# 32; 4 x 1024 tokens: 173, 123 (128), 113 (64) ms).
FLASH_BLOCK = 512
FLASH_BLOCK_CPU = 64


_COMPILE_PLATFORM = contextvars.ContextVar('compile_platform', default=None)


def compiling_for(platform: str):
  """Trace-time context: the model is traced for devices of `platform` (`gpu`, `cpu`), which the
  choices below read instead of JAX's default backend (a step compiled for GPUs that are not
  here is traced on a CPU)."""
  return trace_setting(_COMPILE_PLATFORM, platform)


def compile_platform() -> str:
  """The platform the model is being traced for: `compiling_for`'s, else JAX's backend."""
  return _COMPILE_PLATFORM.get() or jax.default_backend()


def flash_block(backend: str | None = None) -> int:
  """Positions per flash block on `backend` (default: the one compiled for)."""
  return FLASH_BLOCK_CPU if (backend or compile_platform()) == 'cpu' else FLASH_BLOCK
_MASKED = float(jnp.finfo(jnp.float32).min)


def _sixteen_bit(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def resolve(attention: str, compute_dtype, backend: str | None = None) -> str:
  """The implementation `attention` stands for on `backend` (default: the one compiled for)."""
  if attention != 'auto':
    return attention
  backend = backend or compile_platform()
  return 'cudnn' if backend == 'gpu' and _sixteen_bit(compute_dtype) else 'flash'


def refusal(attention: str, compute_dtype, backend: str) -> str | None:
  """Why `attention` cannot run in this compute dtype on this backend (None: it can)."""
  if attention != 'cudnn':
    return None
  if backend != 'gpu':
    return (f"model.attention='cudnn' runs only on a GPU (this run's backend is {backend}); "
            f"use 'flash', 'xla' or 'auto'")
  if not _sixteen_bit(compute_dtype):
    return (f"model.attention='cudnn' needs bf16 or fp16 compute (this precision computes in "
            f"{jnp.dtype(compute_dtype).name}); use 'flash', 'xla' or 'auto'")
  return None


def attend(q: jax.Array, k: jax.Array, v: jax.Array, attention: str,
           segments: jax.Array | None = None) -> jax.Array:
  """Causal attention with the implementation `attention` names (after `resolve`), within each
  segment of `segments` [b, t] when given."""
  attention = resolve(attention, q.dtype)
  if attention == 'xla':
    return xla_attention(q, k, v, segments)
  if attention == 'flash':
    return flash_attention(q, k, v, flash_block(), segments=segments)
  if attention == 'cudnn':
    return cudnn_attention(q, k, v, segments)
  raise ValueError(f'model.attention={attention!r}; allowed: {", ".join(ATTENTIONS)}')


def _groups(q: jax.Array, kv_heads: int) -> jax.Array:
  """q as [b, t, kv_heads, group, d]."""
  b, t, heads, d = q.shape
  return q.reshape(b, t, kv_heads, heads // kv_heads, d)


def _score_scale(d: int) -> float:
  return d ** -0.5


def _dot(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
  return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


def _same_segment(query_segments: jax.Array, key_segments: jax.Array) -> jax.Array:
  """[b, tq], [b, tk] -> [b, tq, tk]: whether query and key lie in the same segment."""
  return query_segments[:, :, None] == key_segments[:, None, :]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                    segments: jax.Array | None = None) -> jax.Array:
  """cuDNN's fused kernel (GPU, 16-bit). Segments go in as a boolean mask [b, 1, t, t] beside its
  own causal mask (it turns the mask into an additive bias: packed rows cost that [t, t] array per
  row, where plain causal rows cost nothing)."""
  mask = None if segments is None else _same_segment(segments, segments)[:, None]
  return jax.nn.dot_product_attention(q, k, v, mask=mask, scale=_score_scale(q.shape[-1]),
                                      is_causal=True, implementation='cudnn')


def xla_attention(q: jax.Array, k: jax.Array, v: jax.Array,
                  segments: jax.Array | None = None) -> jax.Array:
  """The reference: every [t, t] score at once, fp32 softmax."""
  b, t, heads, d = q.shape
  qg = _groups(q, k.shape[2])
  scores = _dot('btkgd,bskd->bkgts', qg, k) * _score_scale(d)
  visible = jnp.tril(jnp.ones((t, t), dtype=bool))
  if segments is not None:
    visible = (visible & _same_segment(segments, segments))[:, None, None]   # [b, 1, 1, t, t]
  probs = jax.nn.softmax(jnp.where(visible, scores, _MASKED), axis=-1).astype(v.dtype)
  return _dot('bkgts,bskd->btkgd', probs, v).astype(q.dtype).reshape(b, t, heads, d)


def cached_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                     start: jax.Array) -> jax.Array:
  """One new position per row: q [b, 1, heads, d] at position start[b] against a key/value cache
  [b, S, kv_heads, d] whose positions up to start[b] are filled (later ones are masked)."""
  b, _, heads, d = q.shape
  qg = _groups(q, k_cache.shape[2])
  scores = _dot('btkgd,bskd->bkgts', qg, k_cache) * _score_scale(d)
  visible = jnp.arange(k_cache.shape[1])[None, :] <= start[:, None]    # [b, S]
  scores = jnp.where(visible[:, None, None, None, :], scores, _MASKED)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
  return _dot('bkgts,bskd->btkgd', probs, v_cache).astype(q.dtype).reshape(b, 1, heads, d)


# ---- flash: blocks of `block` queries against blocks of `block` keys (flash_block) -------------
# Blocked layouts: queries [nq, b, kv_heads, group, block, d], keys and values [nk, b, kv_heads,
# block, d], per-row statistics [nq, b, kv_heads, group, block], segment ids [nq or nk, b, block].
# `at` [nq] int: the key block each query block lies on (ascending). A whole sequence has
# at = 0..n-1; a context shard (models/context.py) holds some query blocks of the sequence and
# attends to all its keys. Query block m attends to key blocks 0..at[m]; without segments only the
# block on the diagonal needs the causal mask. The length is padded up to whole blocks: padded
# keys lie after every real query, so causality already hides them, and padded query rows are cut
# off at the end.
#
# With segments a query row may see no key of an earlier key block (another document). Its scores
# there are all _MASKED, so the running maximum stays _MASKED and those probabilities come out as 1:
# the sum and accumulator gather rubbish, which the first block with a visible key (at the latest
# the diagonal one: a query always sees itself) scales by exp(_MASKED - max) = 0, exactly. The
# log-sum-exp is therefore always that of the visible keys, and the backward pass's probabilities
# exp(_MASKED - lse) are 0.

def _block_mask(i: jax.Array, j: jax.Array, block: int) -> jax.Array:
  rows = i * block + jnp.arange(block)[:, None]
  cols = j * block + jnp.arange(block)[None, :]
  return rows >= cols


def _blocked_queries(x: jax.Array, n: int, block: int) -> jax.Array:
  """[b, n * block, kv, g, d] -> [n, b, kv, g, block, d]."""
  b, _, kv, g, d = x.shape
  return x.reshape(b, n, block, kv, g, d).transpose(1, 0, 3, 4, 2, 5)


def _blocked_keys(x: jax.Array, n: int, block: int) -> jax.Array:
  """[b, n * block, kv, d] -> [n, b, kv, block, d]."""
  b, _, kv, d = x.shape
  return x.reshape(b, n, block, kv, d).transpose(1, 0, 3, 2, 4)


def _blocked_segments(segments: jax.Array | None, n: int, block: int) -> jax.Array | None:
  """[b, n * block] -> [n, b, block]."""
  return None if segments is None else segments.reshape(segments.shape[0], n, block).swapaxes(0, 1)


def _loop(lower, upper, body, init, n: int):
  """fori_loop over block indices; with a single block (n == 1) the body once, so that short
  sequences compile and run without loops."""
  if n == 1:
    return body(jnp.int32(0), init)
  return jax.lax.fori_loop(lower, upper, body, init)


def _over_blocks(body, carry, xs, n: int):
  """lax.scan over the leading (block) axis of xs; with a single block, the body once."""
  if n == 1:
    carry, ys = body(carry, jax.tree.map(lambda x: x[0], xs))
    return carry, jax.tree.map(lambda y: y[None], ys)
  return jax.lax.scan(body, carry, xs)


def _scores(qi, kj, i, j, block, query_segments, key_segments):
  """Scores of a query block on key block i against key block j, masked; the segment ids of
  those query and key rows [b, block] (or None)."""
  s = _dot('bkgqd,bksd->bkgqs', qi, kj) * _score_scale(qi.shape[-1])
  visible = _block_mask(i, j, block)
  if query_segments is not None:
    visible = (visible & _same_segment(query_segments, key_segments))[:, None, None]
  return jnp.where(visible, s, _MASKED)


def _flash_forward(qb, kb, vb, qsb, ksb, at, key_at=None):
  """Blocked outputs (in the compute dtype) and each row's log-sum-exp of the scores (fp32).

  `key_at` [nk] (ascending): the blocks of the sequence the key blocks are, when they are not
  0..nk-1 (a ring step's blocks, models/context.py). Then a query row may see no key at all: its
  output is 0 and its log-sum-exp _MASKED, and the output stays in fp32 (a partial result that
  is merged with the other steps' by their log-sum-exp)."""
  block = qb.shape[-2]

  def query_block(_, inputs):
    qi, i, si = inputs

    def key_block(j, carry):
      row_max, row_sum, acc = carry
      s = _scores(qi, kb[j], i, j if key_at is None else key_at[j], block, si,
                  None if ksb is None else ksb[j])
      new_max = jnp.maximum(row_max, s.max(axis=-1))
      p = jnp.exp(s - new_max[..., None])
      fade = jnp.exp(row_max - new_max)
      acc = acc * fade[..., None] + _dot('bkgqs,bksd->bkgqd', p.astype(vb.dtype), vb[j])
      return new_max, row_sum * fade + p.sum(axis=-1), acc

    stats = jnp.full(qi.shape[:-1], _MASKED, jnp.float32)
    init = (stats, jnp.zeros_like(stats), jnp.zeros(qi.shape, jnp.float32))
    if key_at is not None:   # the key blocks at or before query block i: a prefix, maybe empty
      row_max, row_sum, acc = jax.lax.fori_loop(0, jnp.sum(key_at <= i), key_block, init)
      seen = row_sum > 0
      out = jnp.where(seen[..., None], acc / jnp.where(seen, row_sum, 1)[..., None], 0)
      return None, (out, jnp.where(seen, row_max + jnp.log(jnp.where(seen, row_sum, 1)), _MASKED))
    row_max, row_sum, acc = _loop(0, i + 1, key_block, init, kb.shape[0])
    out = (acc / row_sum[..., None]).astype(qi.dtype)
    return None, (out, row_max + jnp.log(row_sum))

  _, (out, lse) = _over_blocks(query_block, None, (qb, at, qsb), qb.shape[0])
  return out, lse


def _flash_backward(qb, kb, vb, qsb, ksb, at, out, lse, d_out, key_at=None):
  """Gradients of the blocked q, k, v: key block j's dk and dv gather over the query blocks on
  key blocks j and later; each block's probabilities are rebuilt from the saved log-sum-exp (no
  [t, t] block is kept). `key_at` as `_flash_forward` takes it; with it (a ring step: `out` and
  `lse` are the whole row's) the gradients stay in fp32, to be summed over the steps."""
  nq, block = qb.shape[0], qb.shape[-2]
  whole = key_at is None and nq == kb.shape[0]   # a whole sequence: at = 0..n-1
  dtype = qb.dtype
  # D_i = rowsum(dO * O): the softmax's backward without the probabilities of the whole row.
  delta = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)

  def key_block(dq, inputs):
    kj, vj, j, sj = inputs

    position = j if key_at is None else key_at[j]

    def query_block(m, carry):
      dq, dk, dv = carry
      qi, d_out_i = qb[m], d_out[m]
      s = _scores(qi, kj, m if whole else at[m], position, block,
                  None if qsb is None else qsb[m], sj)
      p = jnp.exp(s - lse[m][..., None])
      dv = dv + _dot('bkgqs,bkgqd->bksd', p.astype(dtype), d_out_i)
      dp = _dot('bkgqd,bksd->bkgqs', d_out_i, vj)
      # The scores' gradient, times the scale the scores were multiplied by: dq and dk are the
      # gradients of the unscaled q and k.
      ds = (p * (dp - delta[m][..., None]) * _score_scale(qi.shape[-1])).astype(dtype)
      dq = dq.at[m].add(_dot('bkgqs,bksd->bkgqd', ds, kj))
      dk = dk + _dot('bkgqs,bkgqd->bksd', ds, qi)
      return dq, dk, dv

    zeros = jnp.zeros(kj.shape, jnp.float32)
    # The first query block that sees key block j (`at` ascending); on a whole sequence, j.
    first = j if whole else jnp.sum(at < position)
    dq, dk, dv = _loop(first, nq, query_block, (dq, zeros, zeros), nq)
    return dq, (dk, dv)

  dq, (dk, dv) = _over_blocks(key_block, jnp.zeros(qb.shape, jnp.float32),
                              (kb, vb, jnp.arange(kb.shape[0]), ksb), kb.shape[0])
  if key_at is not None:
    return dq, dk, dv
  return dq.astype(dtype), dk.astype(kb.dtype), dv.astype(vb.dtype)


# The blocked segment ids (or None) and `at` are inputs like q, k and v, so that the function is
# traced once per shape whatever their values; being integers they have no gradient (float0 zeros).
@jax.custom_vjp
def _flash_blocked(qb, kb, vb, qsb, ksb, at):
  return _flash_forward(qb, kb, vb, qsb, ksb, at)[0]


def _flash_blocked_fwd(qb, kb, vb, qsb, ksb, at):
  out, lse = _flash_forward(qb, kb, vb, qsb, ksb, at)
  # On a whole sequence (as many query blocks as key blocks) `at` is 0..n-1 and is not kept.
  kept_at = None if qb.shape[0] == kb.shape[0] else at
  return out, (qb, kb, vb, qsb, ksb, kept_at, out, lse)


def _flash_blocked_bwd(residuals, d_out):
  no_grad = lambda shape: np.zeros(shape, jax.dtypes.float0)
  qsb, ksb = residuals[3:5]
  return (*_flash_backward(*residuals, d_out),
          *(None if x is None else no_grad(x.shape) for x in (qsb, ksb)),
          no_grad(residuals[0].shape[:1]))


_flash_blocked.defvjp(_flash_blocked_fwd, _flash_blocked_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, block: int = FLASH_BLOCK,
                    segments: jax.Array | None = None) -> jax.Array:
  """Blockwise causal attention (within segments when given); `block` query (and key) positions
  per block."""
  t = q.shape[1]
  block = min(block, t)
  n = -(-t // block)
  pad = [(0, 0), (0, n * block - t)]
  # Padded positions get segment 0 like padding; causality hides them from every real query.
  padded = lambda x: jnp.pad(x, pad + [(0, 0)] * (x.ndim - 2))
  segments = None if segments is None else padded(segments)
  out = flash_attention_at(*map(padded, (q, k, v)), jnp.arange(n), block, segments, segments)
  return out[:, :t]


def flash_attention_at(q: jax.Array, k: jax.Array, v: jax.Array, at: jax.Array, block: int,
                       query_segments: jax.Array | None = None,
                       key_segments: jax.Array | None = None) -> jax.Array:
  """Blockwise causal attention of queries q [b, len(at) * block, heads, d] whose blocks lie at
  key blocks `at` (ascending) of the keys k, v [b, n * block, kv_heads, d]: query block m holds
  positions at[m] * block + 0..block-1. Segment ids [b, ...] of the queries and of the keys, or
  None for both."""
  b, _, heads, d = q.shape
  kv_heads, nq, nk = k.shape[2], len(at), k.shape[1] // block
  qb = _blocked_queries(_groups(q, kv_heads), nq, block)
  kb, vb = (_blocked_keys(x, nk, block) for x in (k, v))
  out = _flash_blocked(qb, kb, vb, _blocked_segments(query_segments, nq, block),
                       _blocked_segments(key_segments, nk, block), at)
  return out.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * block, heads, d)
