"""The floor any JAX user gets for free: the same decoder as bench/eager_torch.py written as plain
JAX and optax in an afternoon (parameters in a dict, layers in a Python loop,
`jax.nn.dot_product_attention`, `optax.adamw` with clipping, one jitted step), with none of this
project's machinery (no scan, no sharding rules, no skip of non-finite steps, no data pipeline).

`precision`: 'fp32', 'bf16' (parameters, activations and Adam's moments in bf16, as the
PyTorch loop's `model.to(torch.bfloat16)`) or 'bf16_mixed' (fp32 parameters and Adam, the
parameters cast to bf16 for the forward: what a JAX user writes for the PyTorch loop's autocast).
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax


def init(s: dict, dtype) -> dict:
  d, h, kv, hd, m = s['d_model'], s['num_heads'], s['num_kv_heads'], s['head_dim'], s['mlp_dim']
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 4 + 7 * s['num_layers']))
  normal = lambda *shape: (0.02 * jax.random.normal(next(keys), shape)).astype(dtype)
  params = {'embedding': normal(s['vocab_size'], d), 'final_norm': jnp.ones(d, dtype),
            'blocks': [dict(attention_norm=jnp.ones(d, dtype), query=normal(d, h * hd),
                            key=normal(d, kv * hd), value=normal(d, kv * hd), out=normal(h * hd, d),
                            mlp_norm=jnp.ones(d, dtype), gate=normal(d, m), up=normal(d, m),
                            down=normal(m, d)) for _ in range(s['num_layers'])]}
  if not s['tie_embeddings']:
    params['head'] = normal(d, s['vocab_size'])
  return params


def rms_norm(x, scale):
  x32 = x.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-5)
  return (normed * scale.astype(jnp.float32)).astype(x.dtype)


def apply_rope(x, cos, sin):
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


PRECISIONS = ('fp32', 'bf16', 'bf16_mixed')


def loss_fn(params, tokens, s):
  if s['precision'] == 'bf16_mixed':
    params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  b, t = tokens.shape[0], tokens.shape[1] - 1
  h, kv, hd = s['num_heads'], s['num_kv_heads'], s['head_dim']
  inv_freq = 10000.0 ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)
  angles = jnp.arange(t, dtype=jnp.float32)[:, None] * inv_freq
  cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
  x = params['embedding'][tokens[:, :-1]]
  for p in params['blocks']:
    y = rms_norm(x, p['attention_norm'])
    q = apply_rope((y @ p['query']).reshape(b, t, h, hd), cos, sin)
    k = apply_rope((y @ p['key']).reshape(b, t, kv, hd), cos, sin)
    v = (y @ p['value']).reshape(b, t, kv, hd)
    attended = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    x = x + attended.reshape(b, t, h * hd) @ p['out']
    y = rms_norm(x, p['mlp_norm'])
    x = x + (jax.nn.silu(y @ p['gate']) * (y @ p['up'])) @ p['down']
  x = rms_norm(x, params['final_norm'])
  head = params['embedding'].T if s['tie_embeddings'] else params['head']
  logits = (x @ head).astype(jnp.float32)
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


class Trainer:
  """The model, its optimizer and a batch stream; `run(n)` trains n steps and returns the seconds."""

  def __init__(self, s: dict):
    if s['precision'] not in PRECISIONS:
      raise ValueError(f'precision={s["precision"]!r}; the plain JAX step runs '
                       f'{", ".join(PRECISIONS)}')
    self.s = s
    self.params = init(s, jnp.bfloat16 if s['precision'] == 'bf16' else jnp.float32)
    self.tx = optax.chain(optax.clip_by_global_norm(1.0),
                          optax.adamw(1e-3, b1=0.9, b2=0.95, weight_decay=0.1))
    self.opt_state = self.tx.init(self.params)

    @jax.jit
    def step(params, opt_state, tokens):
      loss, grads = jax.value_and_grad(loss_fn)(params, tokens, s)
      updates, opt_state = self.tx.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, loss

    self._step = step
    self.rng = np.random.default_rng(0)
    self.loss = float('nan')

  def step(self) -> None:
    s = self.s
    tokens = self.rng.integers(0, s['vocab_size'], (s['batch_size'], s['seq_len'] + 1), np.int32)
    self.params, self.opt_state, loss = self._step(self.params, self.opt_state, tokens)
    self.loss = loss   # read once at the end of a round, as a user's loop reads it when logging

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.step()
    self.loss = float(self.loss)
    return time.perf_counter() - start
