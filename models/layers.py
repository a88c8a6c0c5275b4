"""The blocks of the decoder: RMSNorm or LayerNorm, rotary embeddings, grouped-query attention
(its implementations: models/attention.py), SwiGLU or GELU MLP (Llama by default; GPT-2 through
the model options in models/config.py).

Each part runs under a name scope (`norm`, `attention`, `mlp`) that its operations carry into the
compiled program, so a profile can tell them apart (bench/profile.py).

Every block passes an `AdapterCall` (models/dense.py) down to its dense layers: LoRA dropout keys and
the reference-rows mask; None when the model has no adapters or runs without dropout."""
import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from models.attention import attend, cached_attention, compile_platform
from models.config import ModelConfig
from models.context import context_attention, sequence_shards
from models.dense import AdapterCall, Dense, logical_param
from models.hints import constrain
from models.rmsnorm import normalize, rms_norm
from models.swiglu import swiglu
from precision.policy import Policy


class RMSNorm(nnx.Module):
  """x / rms(x) * scale, computed in fp32 whatever the compute dtype (the mean of squares underflows in 16 bits)."""

  def __init__(self, dim: int, *, eps: float, policy: Policy):
    self.eps = eps
    self.policy = policy
    self.scale = logical_param(jnp.ones((dim,), policy.param_dtype), ('embed',))

  @jax.named_scope('norm')
  def __call__(self, x: jax.Array) -> jax.Array:
    scale, dtype = self.scale[...], self.policy.compute_dtype
    # Off the CPU the backward keeps only the input and a number per row (models/rmsnorm.py);
    # XLA:CPU keeps autodiff's program, which every CPU figure was calibrated on.
    if compile_platform() != 'cpu':
      return rms_norm(x, scale, self.eps, dtype)
    return normalize(x, scale, self.eps, dtype)[0]


class LayerNorm(nnx.Module):
  """(x - mean) / std * scale + bias (GPT-2), in fp32 whatever the compute dtype."""

  def __init__(self, dim: int, *, eps: float, policy: Policy):
    self.eps = eps
    self.policy = policy
    self.scale = logical_param(jnp.ones((dim,), policy.param_dtype), ('embed',))
    self.bias = logical_param(jnp.zeros((dim,), policy.param_dtype), ('embed',))

  @jax.named_scope('norm')
  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    centred = x32 - jnp.mean(x32, axis=-1, keepdims=True)
    normed = centred * jax.lax.rsqrt(jnp.mean(centred * centred, axis=-1, keepdims=True) + self.eps)
    out = normed * self.scale[...].astype(jnp.float32) + self.bias[...].astype(jnp.float32)
    return out.astype(self.policy.compute_dtype)


def make_norm(cfg: ModelConfig, policy: Policy) -> nnx.Module:
  norm = RMSNorm if cfg.norm == 'rms' else LayerNorm
  return norm(cfg.d_model, eps=cfg.norm_eps, policy=policy)


def split_call(call: AdapterCall | None, n: int) -> list[AdapterCall | None]:
  """One AdapterCall per sub-layer, each with its own dropout key."""
  if call is None or call.dropout_key is None:
    return [call] * n
  return [call.for_layer(k) for k in jax.random.split(call.dropout_key, n)]


def llama3_inv_freq(inv_freq: jax.Array, cfg: ModelConfig) -> jax.Array:
  """Llama 3's RoPE scaling: frequencies whose wavelength exceeds what pretraining saw are slowed
  by `rope_factor` (so long contexts reuse angles the model knows), short wavelengths that encode
  local order are kept, and the band between is blended linearly in
  original_max_len / wavelength."""
  factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
  wavelength = 2 * jnp.pi / inv_freq
  blend = (cfg.rope_original_max_len / wavelength - low) / (high - low)
  blended = (1 - blend) * inv_freq / factor + blend * inv_freq
  return jnp.where(wavelength > cfg.rope_original_max_len / low, inv_freq / factor,
                   jnp.where(wavelength < cfg.rope_original_max_len / high, inv_freq, blended))


def rope_tables(positions: jax.Array, head_dim: int, theta: float,
                scaling: ModelConfig | None = None) -> tuple[jax.Array, jax.Array]:
  """cos and sin of shape [batch, length, head_dim // 2] for integer positions [batch, length].

  `scaling`: the model config, whose rope_scaling option adjusts the frequencies (None: plain
  RoPE)."""
  inv_freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
  if scaling is not None and scaling.rope_scaling == 'llama3':
    inv_freq = llama3_inv_freq(inv_freq, scaling)
  angles = positions.astype(jnp.float32)[..., None] * inv_freq
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate [batch, length, heads, head_dim] in Llama's half-rotation layout:
  dimension i pairs with i + head_dim/2 (not with its neighbour, as in the original RoFormer)."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[:, :, None, :], sin[:, :, None, :]
  rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return rotated.astype(x.dtype)


class Attention(nnx.Module):
  """Causal self-attention; num_kv_heads < num_heads shares each K/V head among a group of query heads."""

  def __init__(self, cfg: ModelConfig, *, policy: Policy, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    std = cfg.init_std
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5  # GPT-2: residual projections scaled by depth
    self.cfg = cfg
    dense = dict(policy=policy, rngs=rngs, use_bias=cfg.bias)
    self.query = Dense(d, (h, hd), axes=('embed', 'heads', 'head_dim'), init_std=std, **dense)
    self.key = Dense(d, (kv, hd), axes=('embed', 'kv_heads', 'head_dim'), init_std=std, **dense)
    self.value = Dense(d, (kv, hd), axes=('embed', 'kv_heads', 'head_dim'), init_std=std, **dense)
    self.out = Dense((h, hd), d, axes=('heads', 'head_dim', 'embed'), init_std=out_std, **dense)

  @jax.named_scope('attention')
  def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
               adapters: AdapterCall | None = None,
               segments: jax.Array | None = None) -> jax.Array:
    """`cos`/`sin` None: no rotary embeddings (learned positions were added to the input).
    `segments` [b, t]: packed rows, each position attends within its own segment."""
    on_q, on_k, on_v, on_out = split_call(adapters, 4)
    q, k, v = self._project(x, cos, sin, on_q, on_k, on_v)
    q, k, v = checkpoint_name(q, 'query'), checkpoint_name(k, 'key'), checkpoint_name(v, 'value')
    context_shards = sequence_shards()
    if context_shards > 1:   # the sequence split over devices, in zigzag order (models/context.py)
      attended = context_attention(q, k, v, segments, context_shards, self.cfg.context_attention)
    else:
      attended = attend(q, k, v, self.cfg.attention, segments)
    attended = constrain(attended, ('batch', 'length', 'heads', 'head_dim'))
    return self.out(attended, on_out)

  def with_cache(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
                 cache: tuple[jax.Array, jax.Array], start: jax.Array):
    """Generation: x [b, t, d_model], row r at positions start[r] + 0..t-1, written into the
    cache's keys and values [b, S, kv_heads, head_dim] and attending to them. t > 1 is a prompt
    from position 0 (it attends to itself, with the model's attention); t == 1 a next token.
    Returns (output, cache)."""
    q, k, v = self._project(x, cos, sin, None, None, None)
    write = jax.vmap(lambda cached, new, at: jax.lax.dynamic_update_slice(
        cached, new.astype(cached.dtype), (at, 0, 0)))
    cache = tuple(write(cached, new, start) for cached, new in zip(cache, (k, v)))
    if x.shape[1] > 1:
      attended = attend(q, k, v, self.cfg.attention)
    else:
      attended = cached_attention(q, *cache, start)
    return self.out(attended), cache

  def _project(self, x, cos, sin, on_q, on_k, on_v):
    q = constrain(self.query(x, on_q), ('batch', 'length', 'heads', 'head_dim'))
    k = constrain(self.key(x, on_k), ('batch', 'length', 'kv_heads', 'head_dim'))
    v = constrain(self.value(x, on_v), ('batch', 'length', 'kv_heads', 'head_dim'))
    if cos is not None:
      q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    return q, k, v


class MLP(nnx.Module):
  """SwiGLU: down(silu(gate(x)) * up(x)); or GPT-2's down(gelu_tanh(up(x))), which has no gate."""

  def __init__(self, cfg: ModelConfig, *, policy: Policy, rngs: nnx.Rngs):
    d, m = cfg.d_model, cfg.mlp_dim
    out_std = cfg.init_std / (2 * cfg.num_layers) ** 0.5
    dense = dict(policy=policy, rngs=rngs, use_bias=cfg.bias)
    self.gate = (Dense(d, m, axes=('embed', 'mlp'), init_std=cfg.init_std, **dense)
                 if cfg.mlp == 'swiglu' else None)
    self.up = Dense(d, m, axes=('embed', 'mlp'), init_std=cfg.init_std, **dense)
    self.down = Dense(m, d, axes=('mlp', 'embed'), init_std=out_std, **dense)

  @jax.named_scope('mlp')
  def __call__(self, x: jax.Array, adapters: AdapterCall | None = None) -> jax.Array:
    on_gate, on_up, on_down = split_call(adapters, 3)
    if self.gate is None:
      hidden = jax.nn.gelu(self.up(x, on_up), approximate=True)
    else:
      gate, up = self.gate(x, on_gate), self.up(x, on_up)
      # Off the CPU the product keeps only its inputs for the backward (models/swiglu.py); XLA:CPU
      # keeps autodiff's program, which every CPU figure was calibrated on.
      hidden = (swiglu(gate, up) if compile_platform() != 'cpu' else jax.nn.silu(gate) * up)
    hidden = constrain(hidden, ('batch', 'length', 'mlp'))
    return self.down(hidden, on_down)


class Block(nnx.Module):
  """Pre-norm residual block: x + attention(norm(x)), then x + mlp(norm(x))."""

  def __init__(self, cfg: ModelConfig, *, policy: Policy, rngs: nnx.Rngs):
    self.attention_norm = make_norm(cfg, policy)
    self.attention = Attention(cfg, policy=policy, rngs=rngs)
    self.mlp_norm = make_norm(cfg, policy)
    self.mlp = MLP(cfg, policy=policy, rngs=rngs)

  def __call__(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
               adapters: AdapterCall | None = None,
               segments: jax.Array | None = None) -> jax.Array:
    on_attention, on_mlp = split_call(adapters, 2)
    x = x + self.attention(self.attention_norm(x), cos, sin, on_attention, segments)
    return self._mlp_residual(x, on_mlp)

  def with_cache(self, x: jax.Array, cos: jax.Array | None, sin: jax.Array | None,
                 cache: tuple[jax.Array, jax.Array], start: jax.Array):
    """Generation (Attention.with_cache): returns (output, cache)."""
    attended, cache = self.attention.with_cache(self.attention_norm(x), cos, sin, cache, start)
    return self._mlp_residual(x + attended, None), cache

  def _mlp_residual(self, x, adapters):
    x = constrain(x, ('batch', 'length', 'embed'))
    x = x + self.mlp(self.mlp_norm(x), adapters)
    return constrain(x, ('batch', 'length', 'embed'))
