"""The yardstick: the same decoder trained by a plain PyTorch eager loop (no `torch.compile`).

Token embedding -> N x [RMSNorm -> causal grouped-query attention with RoPE (Llama's half
rotation, `F.scaled_dot_product_attention`) -> RMSNorm -> SwiGLU MLP], no biases, final RMSNorm,
a tied or untied head, next-token cross-entropy, AdamW with global-norm clipping: what a
researcher writes in PyTorch in an afternoon. `torch` is a test-only requirement; bench/versus.py
runs this file in a process of its own (and tests/test_versus.py checks it).

`precision`: 'fp32' (everything fp32), 'bf16' (weights, activations and Adam's moments in bf16,
as `model.to(torch.bfloat16)` gives; PyTorch's CPU matmuls run bf16 natively where the CPU has
AVX512_BF16 or AMX) or 'bf16_mixed' (fp32 weights and Adam, the forward under
`torch.autocast(dtype=torch.bfloat16)`: bf16 matmuls and attention, fp32 norms, softmax and loss;
our `bf16_mixed`).

`device`: 'cpu' or 'cuda'; on CUDA AdamW runs fused (`fused=True`, one kernel for the update),
as torchtitan's does. `compiled`: the forward and the loss under `torch.compile` (Inductor fuses
the norms, RoPE, SwiGLU and the cross-entropy; the backward is compiled with them), the optimizer
and the clipping eager, as torchtitan compiles its model.
"""
import math
import time

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):

  def __init__(self, dim: int, eps: float):
    super().__init__()
    self.eps = eps
    self.scale = nn.Parameter(torch.ones(dim))

  def forward(self, x):
    x32 = x.float()
    normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
    return (normed * self.scale.float()).to(x.dtype)


def rope_tables(length: int, head_dim: int, theta: float):
  inv_freq = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
  angles = torch.arange(length, dtype=torch.float32)[:, None] * inv_freq
  return angles.cos(), angles.sin()     # [length, head_dim / 2]


def apply_rope(x, cos, sin):
  """x [batch, heads, length, head_dim]: dimension i pairs with i + head_dim / 2."""
  x1, x2 = x.float().chunk(2, dim=-1)
  return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Block(nn.Module):

  def __init__(self, s: dict):
    super().__init__()
    d, h, kv, hd, m = s['d_model'], s['num_heads'], s['num_kv_heads'], s['head_dim'], s['mlp_dim']
    self.h, self.kv, self.hd = h, kv, hd
    self.attention_norm = RMSNorm(d, 1e-5)
    self.query = nn.Linear(d, h * hd, bias=False)
    self.key = nn.Linear(d, kv * hd, bias=False)
    self.value = nn.Linear(d, kv * hd, bias=False)
    self.out = nn.Linear(h * hd, d, bias=False)
    self.mlp_norm = RMSNorm(d, 1e-5)
    self.gate = nn.Linear(d, m, bias=False)
    self.up = nn.Linear(d, m, bias=False)
    self.down = nn.Linear(m, d, bias=False)

  def forward(self, x, cos, sin):
    b, t, _ = x.shape
    y = self.attention_norm(x)
    q = self.query(y).view(b, t, self.h, self.hd).transpose(1, 2)
    k = self.key(y).view(b, t, self.kv, self.hd).transpose(1, 2)
    v = self.value(y).view(b, t, self.kv, self.hd).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    attended = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                              enable_gqa=self.kv != self.h)
    x = x + self.out(attended.transpose(1, 2).reshape(b, t, self.h * self.hd))
    y = self.mlp_norm(x)
    return x + self.down(F.silu(self.gate(y)) * self.up(y))


class Transformer(nn.Module):

  def __init__(self, s: dict):
    super().__init__()
    self.embedding = nn.Embedding(s['vocab_size'], s['d_model'])
    self.blocks = nn.ModuleList(Block(s) for _ in range(s['num_layers']))
    self.final_norm = RMSNorm(s['d_model'], 1e-5)
    self.head = None if s['tie_embeddings'] else nn.Linear(s['d_model'], s['vocab_size'], bias=False)
    cos, sin = rope_tables(s['seq_len'], s['head_dim'], 10000.0)
    self.register_buffer('cos', cos, persistent=False)
    self.register_buffer('sin', sin, persistent=False)
    for p in self.parameters():
      if p.dim() > 1:
        nn.init.normal_(p, std=0.02)

  def forward(self, tokens):
    x = self.embedding(tokens)
    for block in self.blocks:
      x = block(x, self.cos, self.sin)
    x = self.final_norm(x)
    weight = self.embedding.weight if self.head is None else self.head.weight
    return F.linear(x, weight).float()   # fp32 logits, as ours


PRECISIONS = ('fp32', 'bf16', 'bf16_mixed')
DEVICES = ('cpu', 'cuda')


def next_token_loss(model: Transformer, tokens, vocab_size: int, autocast_device: str | None):
  """The mean cross-entropy of each next token; the forward under bf16 autocast where
  `autocast_device` names its device (the logits are fp32 either way: `Transformer.forward`)."""
  with torch.autocast(autocast_device or 'cpu', dtype=torch.bfloat16,
                      enabled=autocast_device is not None):
    logits = model(tokens[:, :-1])
  return F.cross_entropy(logits.view(-1, vocab_size), tokens[:, 1:].reshape(-1))


class Trainer:
  """One model, its optimizer and a batch stream; `run(n)` trains n steps and returns the seconds."""

  def __init__(self, s: dict, threads: int, device: str = 'cpu', compiled: bool = False):
    if s['precision'] not in PRECISIONS:
      raise ValueError(f'precision={s["precision"]!r}; the PyTorch loop runs '
                       f'{", ".join(PRECISIONS)}')
    if device not in DEVICES:
      raise ValueError(f'device={device!r}; the PyTorch loop runs on {" or ".join(DEVICES)}')
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    self.s, self.device = s, torch.device(device)
    self.model = Transformer(s).to(self.device)
    if s['precision'] == 'bf16':
      self.model = self.model.to(torch.bfloat16)
    self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3, betas=(0.9, 0.95),
                                       weight_decay=0.1, fused=device == 'cuda' or None)
    autocast_device = device if s['precision'] == 'bf16_mixed' else None
    loss_of = lambda tokens: next_token_loss(self.model, tokens, s['vocab_size'], autocast_device)
    self.loss_of = torch.compile(loss_of) if compiled else loss_of
    self.generator = torch.Generator(self.device).manual_seed(0)
    self.last_loss = None
    self.loss = math.nan

  def step(self) -> None:
    s = self.s
    tokens = torch.randint(0, s['vocab_size'], (s['batch_size'], s['seq_len'] + 1),
                           generator=self.generator, device=self.device)
    loss = self.loss_of(tokens)
    self.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
    self.optimizer.step()
    self.last_loss = loss.detach()

  def run(self, steps: int) -> float:
    """Seconds for `steps` steps, the device's queue drained; the loss is read once at the end, as
    a loop reads it when it logs (a read every step would stall a GPU's queue each step)."""
    start = time.perf_counter()
    for _ in range(steps):
      self.step()
    self.loss = math.nan if self.last_loss is None else self.last_loss.item()
    return time.perf_counter() - start
