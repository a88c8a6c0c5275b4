"""Which Hugging Face tensor holds each of our parameters, and how the two layouts differ.

One `Link` joins one of our parameters (one layer of it, when it is stacked under `blocks`) to a
part of one HF tensor. Import and export both read this one table, so they cannot disagree.
Layouts: torch `nn.Linear` (Llama) stores [out, in], so its weights are transposed; GPT-2's
`Conv1D` stores [in, out] as we do, but packs query, key and value side by side in `c_attn`
(weight [d, 3d], bias [3d]), so each of our three projections is a column range of it.
"""
import dataclasses
import re

import numpy as np

from models.config import ModelConfig

GPT2_PREFIX = 'transformer.'   # what GPT2LMHeadModel writes; bare GPT2Model checkpoints have none


@dataclasses.dataclass(frozen=True)
class Link:
  path: tuple[str, ...]              # our parameter
  hf_name: str                       # '{i}' stands for the layer of a stacked parameter
  hf_shape: tuple[int, ...]          # the whole HF tensor
  ours: tuple[int, ...]              # one layer of our parameter
  transpose: bool = False            # HF stores [out, in] (torch Linear)
  part: tuple[int, int] | None = None   # [start, stop) of the HF tensor's last axis (packed q/k/v)

  @property
  def stacked(self) -> bool:
    return self.path[0] == 'blocks'

  def our_shape(self, num_layers: int) -> tuple[int, ...]:
    return (num_layers, *self.ours) if self.stacked else self.ours

  def hf_names(self, num_layers: int) -> list[str]:
    if not self.stacked:
      return [self.hf_name]
    return [self.hf_name.format(i=i) for i in range(num_layers)]

  @property
  def part_index(self) -> tuple[slice, ...]:
    """Index of this link's part in the HF tensor (all of it when it is not packed)."""
    if self.part is None:
      return (slice(None),) * len(self.hf_shape)
    return (slice(None),) * (len(self.hf_shape) - 1) + (slice(*self.part),)

  @property
  def part_shape(self) -> tuple[int, ...]:
    if self.part is None:
      return self.hf_shape
    return (*self.hf_shape[:-1], self.part[1] - self.part[0])

  def to_ours(self, x: np.ndarray) -> np.ndarray:
    return (x.T if self.transpose else x).reshape(self.ours)

  def to_hf(self, y: np.ndarray) -> np.ndarray:
    if self.transpose:
      return y.reshape(self.part_shape[::-1]).T
    return y.reshape(self.part_shape)


def _llama(cfg: ModelConfig) -> list[Link]:
  d, h, kv, hd, m, v = (cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim,
                        cfg.vocab_size)
  layer = 'model.layers.{i}.'
  attention, mlp = ('blocks', 'attention'), ('blocks', 'mlp')
  links = [
      Link(('embedding',), 'model.embed_tokens.weight', (v, d), (v, d)),
      Link(('blocks', 'attention_norm', 'scale'), layer + 'input_layernorm.weight', (d,), (d,)),
      Link((*attention, 'query', 'kernel'), layer + 'self_attn.q_proj.weight', (h * hd, d),
           (d, h, hd), transpose=True),
      Link((*attention, 'key', 'kernel'), layer + 'self_attn.k_proj.weight', (kv * hd, d),
           (d, kv, hd), transpose=True),
      Link((*attention, 'value', 'kernel'), layer + 'self_attn.v_proj.weight', (kv * hd, d),
           (d, kv, hd), transpose=True),
      Link((*attention, 'out', 'kernel'), layer + 'self_attn.o_proj.weight', (d, h * hd),
           (h, hd, d), transpose=True),
      Link(('blocks', 'mlp_norm', 'scale'), layer + 'post_attention_layernorm.weight', (d,), (d,)),
      Link((*mlp, 'gate', 'kernel'), layer + 'mlp.gate_proj.weight', (m, d), (d, m),
           transpose=True),
      Link((*mlp, 'up', 'kernel'), layer + 'mlp.up_proj.weight', (m, d), (d, m), transpose=True),
      Link((*mlp, 'down', 'kernel'), layer + 'mlp.down_proj.weight', (d, m), (m, d),
           transpose=True),
      Link(('final_norm', 'scale'), 'model.norm.weight', (d,), (d,)),
  ]
  if not cfg.tie_embeddings:
    links.append(Link(('head', 'kernel'), 'lm_head.weight', (v, d), (d, v), transpose=True))
  return links


def _gpt2(cfg: ModelConfig, prefix: str) -> list[Link]:
  d, h, hd, m, v = cfg.d_model, cfg.num_heads, cfg.head_dim, cfg.mlp_dim, cfg.vocab_size
  layer = prefix + 'h.{i}.'
  attention, mlp = ('blocks', 'attention'), ('blocks', 'mlp')
  links = [Link(('embedding',), prefix + 'wte.weight', (v, d), (v, d)),
           Link(('positions',), prefix + 'wpe.weight', (cfg.max_seq_len, d), (cfg.max_seq_len, d))]
  for norm, hf in (('attention_norm', 'ln_1'), ('mlp_norm', 'ln_2')):
    links += [Link(('blocks', norm, 'scale'), layer + hf + '.weight', (d,), (d,)),
              Link(('blocks', norm, 'bias'), layer + hf + '.bias', (d,), (d,))]
  for k, name in enumerate(('query', 'key', 'value')):
    columns = (k * d, (k + 1) * d)
    links += [Link((*attention, name, 'kernel'), layer + 'attn.c_attn.weight', (d, 3 * d),
                   (d, h, hd), part=columns),
              Link((*attention, name, 'bias'), layer + 'attn.c_attn.bias', (3 * d,), (h, hd),
                   part=columns)]
  links += [
      Link((*attention, 'out', 'kernel'), layer + 'attn.c_proj.weight', (d, d), (h, hd, d)),
      Link((*attention, 'out', 'bias'), layer + 'attn.c_proj.bias', (d,), (d,)),
      Link((*mlp, 'up', 'kernel'), layer + 'mlp.c_fc.weight', (d, m), (d, m)),
      Link((*mlp, 'up', 'bias'), layer + 'mlp.c_fc.bias', (m,), (m,)),
      Link((*mlp, 'down', 'kernel'), layer + 'mlp.c_proj.weight', (m, d), (m, d)),
      Link((*mlp, 'down', 'bias'), layer + 'mlp.c_proj.bias', (d,), (d,)),
      Link(('final_norm', 'scale'), prefix + 'ln_f.weight', (d,), (d,)),
      Link(('final_norm', 'bias'), prefix + 'ln_f.bias', (d,), (d,)),
  ]
  return links


def hf_links(arch: str, cfg: ModelConfig, prefix: str = '') -> list[Link]:
  """Every link of a model; `prefix` is GPT-2's name prefix ('' or 'transformer.')."""
  return _llama(cfg) if arch == 'llama' else _gpt2(cfg, prefix)


# Tensors a checkpoint may hold that are not parameters of the model HF builds from it: rotary
# frequency and causal-mask buffers, and a stored copy of a tied head.
_IGNORED = {
    'llama': re.compile(r'model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq'),
    'gpt2': re.compile(r'(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)'),
}


def ignored(arch: str, name: str, tied: bool) -> bool:
  return (tied and name == 'lm_head.weight') or _IGNORED[arch].fullmatch(name) is not None
