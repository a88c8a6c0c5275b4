"""The decoder-only transformer: embedding, a scanned stack of blocks, final norm, output head.

The blocks are created with `nnx.vmap` (parameters stacked on a leading `layers` axis) and run with
`nnx.scan`, so XLA compiles one block whatever the depth; the remat policy wraps the scanned body.
"""
import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import Block, RMSNorm, rope_tables
from models.sharding import constrain
from quant.dense import Dense, logical_param
from quant.precision import Policy

_REMAT = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    'qkv': jax.checkpoint_policies.save_only_these_names('query', 'key', 'value'),
}


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, policy: Policy, rngs: nnx.Rngs):
    self.cfg = cfg
    self.policy = policy
    embedding = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), policy.param_dtype)
    self.embedding = logical_param(embedding * cfg.init_std, ('vocab', 'embed'))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(rngs: nnx.Rngs) -> Block:
      return Block(cfg, policy=policy, rngs=rngs)

    self.blocks = make_blocks(rngs)
    self.final_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, policy=policy)
    if not cfg.tie_embeddings:
      self.head = Dense(cfg.d_model, cfg.vocab_size, axes=('embed', 'vocab'), policy=policy,
                        rngs=rngs, init_std=cfg.init_std)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """tokens [batch, length] int -> logits [batch, length, vocab] in fp32."""
    cfg, dtype = self.cfg, self.policy.compute_dtype
    if positions is None:
      positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    cos, sin = rope_tables(positions, cfg.head_dim, cfg.rope_theta)
    # Vocabulary-parallel lookup: the table keeps its vocab split (over `tensor`) and is gathered
    # over any other axis first; left to itself XLA may copy the whole table to every device.
    table = constrain(self.embedding[...], ('vocab', None))
    x = jnp.take(table, tokens, axis=0).astype(dtype)
    x = constrain(x, ('batch', 'length', 'embed'))

    def body(x, block):
      return block(x, cos, sin)

    if cfg.remat != 'none':
      body = nnx.remat(body, policy=_REMAT[cfg.remat], prevent_cse=False)
    run_blocks = nnx.scan(body, in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
                          transform_metadata={nnx.PARTITION_NAME: 'layers'})
    x = self.final_norm(run_blocks(x, self.blocks))

    if cfg.tie_embeddings:
      logits = jnp.einsum('bld,vd->blv', x, self.embedding[...].astype(dtype))
    else:
      logits = self.head(x)
    return constrain(logits.astype(jnp.float32), ('batch', 'length', 'vocab'))
