"""The train step's pieces one at a time, in XLA (our code, jit) and in PyTorch eager, at one shape:
where the step loses to PyTorch, and whether the compiler or the memory is the limit.

Each piece is timed forward and backward together (a vjp with a fixed cotangent; in PyTorch,
`backward` with the same) except the optimizer update and the transpose, best of `--repeats`.
Beside the times: the bytes the piece's inputs and outputs hold (what one perfectly fused pass
would read and write), the rate each library moves them at, and the rate a plain streaming op of
the same size reaches in XLA on this machine (bench/measure.py). A piece far below that rate is
limited by the code the compiler makes for it, not by the memory.

  python -m bench.studies.pieces                      # the issue-29 shape (bench/versus.py), fp32
  python -m bench.studies.pieces --shape=small --out=pieces.json

PyTorch is optional (a test-only requirement): without it only XLA's column is printed.
"""
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from bench.measure import streaming_bytes_per_sec
from bench.shapes import SHAPES

_SHAPE = flags.DEFINE_enum('shape', 'issue', list(SHAPES), 'Model and batch shape (bench/shapes.py).')
_REPEATS = flags.DEFINE_integer('repeats', 20, 'Timed calls per piece; the best is reported.')
_THREADS = flags.DEFINE_integer('torch_threads', 2, 'torch.set_num_threads.')
_ONLY = flags.DEFINE_string('only', None, 'Only the pieces whose name matches this regex.')
_OUT = flags.DEFINE_string('out', None, 'Also write the results as JSON to this file.')


def _best(call, repeats: int) -> float:
  call()
  best = float('inf')
  for _ in range(repeats):
    start = time.perf_counter()
    call()
    best = min(best, time.perf_counter() - start)
  return best


def _fwd_bwd(f, *args):
  """f's forward and backward at args, with a cotangent of ones: (outputs, input gradients)."""
  out, pullback = jax.vjp(f, *args)
  return out, pullback(jax.tree.map(jnp.ones_like, out))


def jax_pieces(s: dict) -> dict:
  """name -> (a jitted call, its arguments): our code for each piece at shape `s`."""
  from flax import nnx

  from configs import presets
  from models.attention import attend
  from models.config import ModelConfig
  from models.layers import MLP, RMSNorm, apply_rope, rope_tables
  from models.llama import Transformer
  from optim.adamw import make_optimizer
  from precision.policy import get_policy
  import ml_collections

  policy = get_policy('fp32')
  cfg = ModelConfig(**{**presets.model('small'), **{k: s[k] for k in (
      'vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim', 'mlp_dim',
      'tie_embeddings')}, 'max_seq_len': s['seq_len']})
  b, t, d = s['batch_size'], s['seq_len'], s['d_model']
  keys = iter(jax.random.split(jax.random.PRNGKey(0), 16))
  normal = lambda shape: jax.random.normal(next(keys), shape, jnp.float32)
  x = normal((b, t, d))
  q = normal((b, t, s['num_heads'], s['head_dim']))
  k = normal((b, t, s['num_kv_heads'], s['head_dim']))
  v = normal((b, t, s['num_kv_heads'], s['head_dim']))
  cos, sin = rope_tables(jnp.arange(t)[None], s['head_dim'], cfg.rope_theta)
  norm_graph, norm_params = nnx.split(RMSNorm(d, eps=cfg.norm_eps, policy=policy))
  mlp_graph, mlp_params = nnx.split(MLP(cfg, policy=policy, rngs=nnx.Rngs(0)))
  gate_up = normal((b * t, s['mlp_dim'])), normal((b * t, s['mlp_dim']))
  logits = normal((b * t, s['vocab_size']))
  targets = jax.random.randint(next(keys), (b * t,), 0, s['vocab_size'])
  model_params = nnx.state(Transformer(cfg, policy=policy, rngs=nnx.Rngs(0)), nnx.Param)
  train = ml_collections.ConfigDict(dict(
      learning_rate=1e-3, warmup_steps=0, steps=1000, min_lr_ratio=0.1, weight_decay=0.1,
      b1=0.9, b2=0.95, grad_clip=1.0))
  tx = make_optimizer(train)
  grads = jax.tree.map(lambda p: jnp.full_like(p, 1e-3), model_params)
  import optax

  def adamw(params, grads, opt_state):
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state

  def cross_entropy(logits):
    import optax as o
    return o.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

  mlp = lambda p, x: nnx.merge(mlp_graph, p)(x)
  norm = lambda p, x: nnx.merge(norm_graph, p)(x)
  return {
      'matmul [tokens, d] x [d, mlp], fwd': (jax.jit(lambda a, w: a @ w),
                                             (x.reshape(b * t, d), normal((d, s['mlp_dim'])))),
      'transpose [tokens, mlp]': (jax.jit(lambda a: a.T.copy()), (gate_up[0],)),
      'rmsnorm fwd+bwd': (jax.jit(lambda p, x: _fwd_bwd(norm, p, x)), (norm_params, x)),
      'rope (q and k) fwd+bwd': (jax.jit(lambda q, k: _fwd_bwd(
          lambda q, k: (apply_rope(q, cos, sin), apply_rope(k, cos, sin)), q, k)), (q, k)),
      'swiglu product fwd+bwd': (jax.jit(lambda g, u: _fwd_bwd(
          lambda g, u: jax.nn.silu(g) * u, g, u)), gate_up),
      'attention (flash) fwd+bwd': (jax.jit(lambda q, k, v: _fwd_bwd(
          lambda q, k, v: attend(q, k, v, 'flash'), q, k, v)), (q, k, v)),
      'mlp (3 dense) fwd+bwd': (jax.jit(lambda p, x: _fwd_bwd(mlp, p, x)), (mlp_params, x)),
      'cross-entropy fwd+bwd': (jax.jit(lambda l: _fwd_bwd(cross_entropy, l)), (logits,)),
      'adamw + clipping, all weights': (jax.jit(adamw, donate_argnums=(0, 2)),
                                        (model_params, grads, tx.init(model_params))),
  }


def torch_pieces(s: dict, threads: int) -> dict:
  """name -> a call: the same pieces as PyTorch eager computes them (bench/eager_torch.py)."""
  import torch
  import torch.nn.functional as F

  from bench import eager_torch
  torch.set_num_threads(threads)
  torch.manual_seed(0)
  b, t, d, m = s['batch_size'], s['seq_len'], s['d_model'], s['mlp_dim']
  h, kv, hd = s['num_heads'], s['num_kv_heads'], s['head_dim']
  leaf = lambda *shape: torch.randn(*shape, requires_grad=True)
  x, a, w = leaf(b, t, d), torch.randn(b * t, d), torch.randn(d, m)
  q, k, v = leaf(b, h, t, hd), leaf(b, kv, t, hd), leaf(b, kv, t, hd)
  g, u, logits = leaf(b * t, m), leaf(b * t, m), leaf(b * t, s['vocab_size'])
  targets = torch.randint(0, s['vocab_size'], (b * t,))
  cos, sin = eager_torch.rope_tables(t, hd, 10000.0)
  norm = eager_torch.RMSNorm(d, 1e-5)
  block = eager_torch.Block(s)
  model = eager_torch.Transformer(s)
  for p in model.parameters():
    p.grad = torch.full_like(p, 1e-3)
  optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
  plain = g.detach()

  def backward(*outputs):
    torch.autograd.backward(outputs, [torch.ones_like(o) for o in outputs])

  def mlp():
    y = block.down(F.silu(block.gate(x)) * block.up(x))
    backward(y)

  def adamw():
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()

  return {
      'matmul [tokens, d] x [d, mlp], fwd': lambda: a @ w,
      'transpose [tokens, mlp]': lambda: plain.t().contiguous(),
      'rmsnorm fwd+bwd': lambda: backward(norm(x)),
      'rope (q and k) fwd+bwd': lambda: backward(eager_torch.apply_rope(q, cos, sin),
                                                 eager_torch.apply_rope(k, cos, sin)),
      'swiglu product fwd+bwd': lambda: backward(F.silu(g) * u),
      'attention (flash) fwd+bwd': lambda: backward(F.scaled_dot_product_attention(
          q, k, v, is_causal=True, enable_gqa=kv != h)),
      'mlp (3 dense) fwd+bwd': mlp,
      'cross-entropy fwd+bwd': lambda: backward(F.cross_entropy(logits, targets)),
      'adamw + clipping, all weights': adamw,
  }


def _nbytes(tree) -> int:
  return sum(np.asarray(a).nbytes if not hasattr(a, 'nbytes') else a.nbytes
             for a in jax.tree.leaves(tree))


def main(argv):
  del argv
  s = {**SHAPES[_SHAPE.value], 'precision': 'fp32'}
  repeats = _REPEATS.value
  pieces = jax_pieces(s)
  try:
    theirs = torch_pieces(s, _THREADS.value)
  except ImportError:
    theirs = {}
  rows = []
  for name, (call, args) in pieces.items():
    if _ONLY.value and not re.search(_ONLY.value, name):
      continue
    donated = 'adamw' in name
    # The bytes of one pass: every input and output once (a donated update reads and writes them).
    out = jax.eval_shape(call, *args)
    nbytes = _nbytes(args) + sum(o.size * o.dtype.itemsize for o in jax.tree.leaves(out))
    if donated:
      state = {'args': args}

      def step():
        params, opt_state = call(*state['args'])
        state['args'] = (params, state['args'][1], opt_state)
        jax.block_until_ready(params)
      ours = _best(step, repeats)
    else:
      ours = _best(lambda: jax.block_until_ready(call(*args)), repeats)
    row = {'piece': name, 'bytes': nbytes, 'xla_ms': ours * 1e3,
           'xla_bytes_per_sec': nbytes / ours, 'stream_bytes_per_sec': streaming_bytes_per_sec(nbytes)}
    if name in theirs:
      torch_seconds = _best(theirs[name], repeats)
      row.update(torch_ms=torch_seconds * 1e3, torch_bytes_per_sec=nbytes / torch_seconds)
    rows.append(row)

  print(f'the step\'s pieces at the {_SHAPE.value} shape ({s["batch_size"]} x {s["seq_len"]} tokens, '
        f'd_model {s["d_model"]}, mlp {s["mlp_dim"]}), fp32, best of {repeats}, '
        f'{jax.devices()[0].device_kind}:')
  print(f'  {"piece":36s} {"MB":>7s} {"XLA ms":>8s} {"torch ms":>9s} {"XLA/torch":>9s} '
        f'{"XLA GB/s":>9s} {"torch GB/s":>10s} {"stream GB/s":>11s}')
  for r in rows:
    torch_ms = f'{r["torch_ms"]:9.2f}' if 'torch_ms' in r else f'{"":9s}'
    ratio = f'{r["xla_ms"] / r["torch_ms"]:9.2f}' if 'torch_ms' in r else f'{"":9s}'
    torch_rate = (f'{r["torch_bytes_per_sec"] / 1e9:10.1f}' if 'torch_ms' in r else f'{"":10s}')
    print(f'  {r["piece"]:36s} {r["bytes"] / 1e6:7.1f} {r["xla_ms"]:8.2f} {torch_ms} {ratio} '
          f'{r["xla_bytes_per_sec"] / 1e9:9.1f} {torch_rate} {r["stream_bytes_per_sec"] / 1e9:11.1f}')
  print('  (GB/s: the piece\'s inputs and outputs, once, per second; stream: x * 2 + 1 over as many '
        'bytes, in XLA)')
  if _OUT.value:
    with open(_OUT.value, 'w') as f:
      json.dump({'shape': _SHAPE.value, 'device_kind': jax.devices()[0].device_kind,
                 'jax': jax.__version__, 'rows': rows}, f, indent=2)


if __name__ == '__main__':
  app.run(main)
