"""The model's shape: parameter count and training FLOPs per token, known before any array exists."""
import dataclasses

from models.attention import ATTENTIONS
from models.context import CONTEXT_ATTENTIONS

REMAT_POLICIES = ('none', 'full', 'dots', 'qkv', 'offload', 'dots_offload')
# Fields that say how the step computes, not what the parameters are: a resume or a fine-tune may
# change them freely, and a checkpoint or an imported model does not set them.
COMPUTE_FIELDS = ('remat', 'attention', 'context_attention', 'loss_chunk', 'scan_unroll')
# Architecture options, so that one decoder covers Llama and GPT-2 (Hugging Face import/export):
NORMS = ('rms', 'layer')          # RMSNorm (Llama) or LayerNorm with a bias (GPT-2)
MLPS = ('swiglu', 'gelu')         # down(silu(gate x) * up x) (Llama) or down(gelu_tanh(up x)) (GPT-2)
POSITIONS = ('rope', 'learned')   # rotary (Llama) or a learned table added to the embedding (GPT-2)
# 'llama3' stretches RoPE's long wavelengths for a longer context (Llama 3.1+; models/layers.py).
ROPE_SCALINGS = ('none', 'llama3')


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  d_model: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  mlp_dim: int
  max_seq_len: int
  rope_theta: float = 10000.0
  norm_eps: float = 1e-5
  tie_embeddings: bool = True
  remat: str = 'none'
  attention: str = 'auto'   # xla, flash, cudnn, or auto (models/attention.py)
  # Under mesh.context > 1 (models/context.py): 'gather' (every shard gathers the sequence's keys
  # and values) or 'ring' (they pass from shard to shard).
  context_attention: str = 'gather'
  loss_chunk: int = 0       # > 0: the head and loss run this many positions at a time (models/loss.py)
  # Blocks per iteration of the layer scan: 1 compiles one block whatever the depth; num_layers
  # unrolls the stack (no stacked copies of the saved values: faster on a CPU at a few layers,
  # compile time grows with the depth). The weights stay stacked either way.
  scan_unroll: int = 1
  init_std: float = 0.02
  norm: str = 'rms'
  mlp: str = 'swiglu'
  positions: str = 'rope'
  bias: bool = False        # a bias on every projection (GPT-2)
  # Llama 3 RoPE scaling; the four numbers are read only with rope_scaling='llama3'.
  rope_scaling: str = 'none'
  rope_factor: float = 1.0            # how much the long wavelengths are stretched
  rope_low_freq_factor: float = 1.0   # wavelengths above original_max_len / this are stretched
  rope_high_freq_factor: float = 4.0  # wavelengths below original_max_len / this are kept
  rope_original_max_len: int = 8192   # the context length the model was pretrained at

  @classmethod
  def from_config(cls, model_config) -> 'ModelConfig':
    """From the `model` section of a run config (a ConfigDict or a plain dict)."""
    fields = {f.name for f in dataclasses.fields(cls)}
    values = dict(model_config)
    unknown = sorted(set(values) - fields)
    if unknown:
      raise ValueError(f'model.{unknown[0]} is not a model field; allowed: {", ".join(sorted(fields))}')
    return cls(**values)

  def __post_init__(self):
    for name in ('vocab_size', 'd_model', 'num_layers', 'num_heads', 'num_kv_heads', 'head_dim',
                 'mlp_dim', 'max_seq_len'):
      value = getattr(self, name)
      if not isinstance(value, int) or value < 1:
        raise ValueError(f'model.{name}={value!r}; it must be a positive integer')
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f'model.num_heads={self.num_heads} must be a multiple of '
                       f'model.num_kv_heads={self.num_kv_heads} (grouped-query attention)')
    if self.head_dim % 2:
      raise ValueError(f'model.head_dim={self.head_dim} must be even (rotary embeddings rotate pairs)')
    chunk = self.loss_chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
      raise ValueError(f'model.loss_chunk={chunk!r}; it must be 0 (the whole sequence at once) '
                       f'or a positive number of positions')
    unroll = self.scan_unroll
    if isinstance(unroll, bool) or not isinstance(unroll, int) or not 1 <= unroll <= self.num_layers:
      raise ValueError(f'model.scan_unroll={unroll!r}; it must be a whole number of blocks per '
                       f'scan iteration, from 1 (rolled) to model.num_layers={self.num_layers} '
                       f'(unrolled)')
    for name, allowed in (('remat', REMAT_POLICIES), ('attention', ATTENTIONS),
                          ('context_attention', CONTEXT_ATTENTIONS), ('norm', NORMS),
                          ('mlp', MLPS), ('positions', POSITIONS), ('rope_scaling', ROPE_SCALINGS)):
      if getattr(self, name) not in allowed:
        raise ValueError(f'model.{name}={getattr(self, name)!r}; allowed: {", ".join(allowed)}')
    if self.rope_scaling == 'llama3':
      if self.positions != 'rope':
        raise ValueError(f"model.rope_scaling='llama3' scales rotary embeddings, but "
                         f"model.positions={self.positions!r}; use positions='rope' or "
                         f"rope_scaling='none'")
      self._check_llama3_rope()

  def _check_llama3_rope(self):
    for name in ('rope_factor', 'rope_low_freq_factor', 'rope_high_freq_factor'):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f'model.{name}={value!r}; it must be a number')
    if not self.rope_factor >= 1:
      raise ValueError(f"model.rope_factor={self.rope_factor!r} with rope_scaling='llama3'; "
                       f'it must be >= 1')
    if not self.rope_high_freq_factor > self.rope_low_freq_factor > 0:
      raise ValueError(f'model.rope_low_freq_factor={self.rope_low_freq_factor!r}, '
                       f'model.rope_high_freq_factor={self.rope_high_freq_factor!r}; '
                       f'they must satisfy high_freq_factor > low_freq_factor > 0')
    value = self.rope_original_max_len
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
      raise ValueError(f"model.rope_original_max_len={value!r} with rope_scaling='llama3'; "
                       f'it must be a positive integer')

  def matmul_inputs(self) -> dict[str, int]:
    """The innermost contraction dimension of every projection (where quantization blocks run)."""
    return {'model.d_model': self.d_model, 'model.head_dim': self.head_dim,
            'model.mlp_dim': self.mlp_dim}

  # ---- parameter counts -------------------------------------------------------------------
  @property
  def attention_params_per_layer(self) -> int:
    q_and_o = 2 * self.d_model * self.num_heads * self.head_dim
    k_and_v = 2 * self.d_model * self.num_kv_heads * self.head_dim
    return q_and_o + k_and_v

  @property
  def mlp_params_per_layer(self) -> int:
    return (3 if self.mlp == 'swiglu' else 2) * self.d_model * self.mlp_dim  # gate, up, down

  @property
  def bias_params_per_layer(self) -> int:
    if not self.bias:
      return 0
    attention = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim + self.d_model
    mlp = (2 if self.mlp == 'swiglu' else 1) * self.mlp_dim + self.d_model
    return attention + mlp

  @property
  def norm_params(self) -> int:
    """One norm's parameters: a scale, and a bias for LayerNorm."""
    return self.d_model * (2 if self.norm == 'layer' else 1)

  @property
  def params_per_layer(self) -> int:
    return (self.attention_params_per_layer + self.mlp_params_per_layer
            + self.bias_params_per_layer + 2 * self.norm_params)

  @property
  def embedding_params(self) -> int:
    return self.vocab_size * self.d_model

  @property
  def position_params(self) -> int:
    return self.max_seq_len * self.d_model if self.positions == 'learned' else 0

  @property
  def num_params(self) -> int:
    head = 0 if self.tie_embeddings else self.vocab_size * (self.d_model + self.bias)
    return (self.embedding_params + self.position_params + self.num_layers * self.params_per_layer
            + self.norm_params + head)

  @property
  def matmul_params(self) -> int:
    """Weights that take part in a matmul per token: the layers' projections and the output head."""
    per_layer = self.attention_params_per_layer + self.mlp_params_per_layer
    return self.num_layers * per_layer + self.vocab_size * self.d_model

  def flops_per_token(self, seq_len: int, base_trains: bool = True, causal: bool = False) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM appendix B convention:
    6 per matmul weight, plus 12 * layers * heads * head_dim * seq_len for the attention scores.
    `base_trains=False` (LoRA: the weights are frozen): 4 per matmul weight, the forward pass and
    the gradient of its input, with no gradient of the weight (the adapters' are negligible).
    `causal`: the attention counted over the positions a causal mask keeps, half of them (the
    count MaxText reports since 2025; PaLM's counts every pair)."""
    attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len / (2 if causal else 1)
    return (6 if base_trains else 4) * self.matmul_params + attention
