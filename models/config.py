"""The model's shape: parameter count and training FLOPs per token, known before any array exists."""
import dataclasses

REMAT_POLICIES = ('none', 'full', 'dots', 'qkv')


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
  init_std: float = 0.02

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
    if self.remat not in REMAT_POLICIES:
      raise ValueError(f'model.remat={self.remat!r}; allowed: {", ".join(REMAT_POLICIES)}')

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
    return 3 * self.d_model * self.mlp_dim  # SwiGLU: gate, up, down

  @property
  def params_per_layer(self) -> int:
    return self.attention_params_per_layer + self.mlp_params_per_layer + 2 * self.d_model

  @property
  def embedding_params(self) -> int:
    return self.vocab_size * self.d_model

  @property
  def num_params(self) -> int:
    head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
    return self.embedding_params + self.num_layers * self.params_per_layer + self.d_model + head

  @property
  def matmul_params(self) -> int:
    """Weights that take part in a matmul per token: the layers' projections and the output head."""
    per_layer = self.attention_params_per_layer + self.mlp_params_per_layer
    return self.num_layers * per_layer + self.vocab_size * self.d_model

  def flops_per_token(self, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward), PaLM appendix B convention:
    6 per matmul weight, plus 12 * layers * heads * head_dim * seq_len for the attention scores."""
    attention = 12 * self.num_layers * self.num_heads * self.head_dim * seq_len
    return 6 * self.matmul_params + attention
