"""The decoder-only transformer: embedding, a scanned stack of blocks, final norm, output head.

The blocks are created with `nnx.vmap` (parameters stacked on a leading `layers` axis) and run as
a plain function of their stacked weights by a `Stack`: `scan_layers` (XLA compiles one block
whatever the depth), or a pipeline over stages (parallel/pipeline.py) that the train step passes
in; the remat policy wraps the one block.
Packed rows (several documents per row) come with `segments` [batch, length], a document id per
position (0: padding): attention stays within a document and positions restart at each.
LoRA adapters (models/lora.py) are attached inside the same vmap, so they are stacked like the kernels.
"""
import contextlib
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import Recompute, checkpoint_name
from jax.sharding import PartitionSpec

from models import lora
from models.config import ModelConfig
from models.attention import compile_platform
from models.context import from_zigzag, sequence_shards, to_zigzag, zigzag_order
from models.dense import AdapterCall, Dense, logical_param, weight_casts_recomputed
from models.hints import constrain, logical_specs
from models.layers import Block, make_norm, rope_tables
from models.loss import head_gradient_rounded, token_losses
from precision.policy import Policy
from quant.contraction import DENSE_OUTPUT, wide_product

# The tied head's product, hidden [batch, n, d_model] against the table [vocab, d_model].
TIED_HEAD_DIMS = (((2,), (1,)), ((), ()))
_TO_HOST = dict(offload_src='device', offload_dst='pinned_host')
# The block's input, which the backward pass recomputes the block from: the scan keeps it per
# layer on the device under `full`; the offload policies keep it in host memory instead.
_OFFLOAD_INPUT = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=['block_input'], **_TO_HOST)
# `dots`: the weight matmuls' outputs, plain dot_generals and the dense products whose own VJP hides
# theirs (quant/contraction.py names them).
_SAVE_DOTS = jax.checkpoint_policies.save_from_both_policies(
    jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
    jax.checkpoint_policies.save_only_these_names(DENSE_OUTPUT))
_OFFLOAD_DENSE = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[], names_which_can_be_offloaded=[DENSE_OUTPUT], **_TO_HOST)
_OFFLOAD_DOTS = jax.checkpoint_policies.offload_dot_with_no_batch_dims(**_TO_HOST)


def weights_on_device(tree):
  """`tree` with every array that lives in host memory (a frozen base under
  `parallel.offload_frozen`) brought to the device; the rest as it is."""
  host = jax.memory.Space.Host
  return jax.tree.map(lambda w: jax.device_put(w, jax.memory.Space.Device)
                      if jax.typeof(w).memory_space == host else w, tree)


def _offload_input_and_dots(prim, *args, **params):
  """`dots_offload`: what `dots` saves (the weight matmuls' outputs), and the block's input, in
  host memory."""
  for policy in (_OFFLOAD_INPUT, _OFFLOAD_DENSE, _OFFLOAD_DOTS):
    case = policy(prim, *args, **params)
    if case is not Recompute:
      return case
  return Recompute


_REMAT = {
    'full': jax.checkpoint_policies.nothing_saveable,
    'dots': _SAVE_DOTS,
    'qkv': jax.checkpoint_policies.save_only_these_names('query', 'key', 'value'),
    'offload': _OFFLOAD_INPUT,             # as `full`, the block inputs in host memory
    'dots_offload': _offload_input_and_dots,   # as `dots`, what it saves in host memory
}


# How the block stack runs: stack(layer, layers, x, keys, rows) -> x, where `layers` is the
# blocks' weights stacked on a leading [num_layers] axis (a pytree), `keys` [num_layers] dropout
# keys or None, `rows` None or a pytree of per-row inputs with x's leading batch axis (packed rows'
# `segments`, and their own rotary `cos` and `sin`) that a stack splitting the batch splits with x,
# and layer(x, one_layer_weights, key, rows) -> x applies one block to those rows.
Stack = Callable[[Callable, Any, jax.Array, jax.Array | None, Any], jax.Array]


def scan_layers(layer: Callable, layers, x: jax.Array, keys: jax.Array | None,
                rows=None, unroll: int = 1) -> jax.Array:
  """The blocks one after another: a scan, so XLA compiles one block whatever the depth (`unroll`
  blocks per iteration: `model.scan_unroll`)."""
  def body(x, inputs):
    params, key = inputs
    return layer(x, params, key, rows), None
  return jax.lax.scan(body, x, (layers, keys), unroll=unroll)[0]


def segment_positions(segments: jax.Array) -> jax.Array:
  """Each position's index within its segment, [batch, length] int32: i minus the index where its
  run of equal ids starts (a running maximum of the run starts)."""
  index = jnp.arange(segments.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate([jnp.ones_like(segments[:, :1], bool),
                            segments[:, 1:] != segments[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class Transformer(nnx.Module):

  def __init__(self, cfg: ModelConfig, *, policy: Policy, rngs: nnx.Rngs,
               adapters: lora.LoraSpec | None = None):
    self.cfg = cfg
    self.policy = policy
    embedding = jax.random.normal(rngs.params(), (cfg.vocab_size, cfg.d_model), policy.param_dtype)
    self.embedding = logical_param(embedding * cfg.init_std, ('vocab', 'embed'))
    self.positions = nnx.data(None)
    if cfg.positions == 'learned':   # GPT-2: a learned vector per position, added to the embedding
      table = jax.random.normal(rngs.params(), (cfg.max_seq_len, cfg.d_model), policy.param_dtype)
      self.positions = logical_param(table * cfg.init_std, (None, 'embed'))

    @nnx.split_rngs(splits=cfg.num_layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: 'layers'})
    def make_blocks(rngs: nnx.Rngs) -> Block:
      block = Block(cfg, policy=policy, rngs=rngs)
      lora.attach(block, adapters, prefix='blocks', rngs=rngs, dtype=policy.param_dtype)
      return block

    self.blocks = make_blocks(rngs)
    self.final_norm = make_norm(cfg, policy)
    if not cfg.tie_embeddings:
      self.head = Dense(cfg.d_model, cfg.vocab_size, axes=('embed', 'vocab'), policy=policy,
                        rngs=rngs, init_std=cfg.init_std, use_bias=cfg.bias,
                        out_dtype=jnp.float32)
      if adapters is not None and adapters.matches('head'):
        lora.attach(self.head, adapters, prefix='head', rngs=rngs, dtype=policy.param_dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array | None = None, *,
               segments: jax.Array | None = None, dropout_key: jax.Array | None = None,
               reference: bool = False):
    """tokens [batch, length] int -> logits [batch, length, vocab] in fp32.

    `segments`: packed rows, as in `hidden`.
    `dropout_key`: LoRA dropout on (training); None runs without dropout.
    `reference`: also return the logits with every adapter off, from the same pass:
    (logits, reference_logits)."""
    rows = tokens.shape[0]
    x, head = self.hidden(tokens, positions, segments=segments, dropout_key=dropout_key,
                          reference=reference)
    logits = from_zigzag(head(x), self._context_order(tokens.shape[1]))
    return (logits[:rows], logits[rows:]) if reference else logits

  def token_losses(self, tokens: jax.Array, targets: jax.Array, *,
                   segments: jax.Array | None = None, dropout_key: jax.Array | None = None,
                   stack: 'Stack | None' = None) -> jax.Array:
    """Next-token cross-entropy [batch, length] in nats, 0 where a target is < 0 (not predicted);
    the head runs `model.loss_chunk` positions at a time (models/loss.py). `segments`, `stack`:
    as in `hidden`."""
    x, head = self.hidden(tokens, segments=segments, dropout_key=dropout_key, stack=stack)
    order = self._context_order(tokens.shape[1])
    losses = token_losses(head, x, to_zigzag(targets, order), self.cfg.loss_chunk)
    return from_zigzag(losses, order)

  def loss_sum(self, tokens: jax.Array, targets: jax.Array, *, segments: jax.Array | None = None,
               dropout_key: jax.Array | None = None, stack: 'Stack | None' = None) -> jax.Array:
    """`token_losses` summed, in nats. A pipeline that runs the backward pass in its own loop
    (`stack.runs_loss`: parallel/pipeline_1f1b.py) takes the final norm, head and loss in with
    it, as a function of their weights on one microbatch's hidden states."""
    if not getattr(stack, 'runs_loss', False):
      return self.token_losses(tokens, targets, segments=segments, dropout_key=dropout_key,
                               stack=stack).sum()
    _, layer, layers, keys, rows, call = self._stack_inputs(tokens, None, segments, dropout_key,
                                                            embed=False)
    tokens, positions, _, targets = self._in_context_order(tokens, None, segments, targets)
    # Split into microbatches with the tokens, unless one row serves all.
    embed_rows = {'tokens': tokens, **({} if positions.shape[0] == 1 else {'positions': positions})}

    def embed(weights, rows):
      return self._embed_tokens(weights, rows['tokens'], rows.get('positions', positions))

    norm_graph, norm_weights = nnx.split(self.final_norm)
    head_key = (None if dropout_key is None
                else jax.random.fold_in(dropout_key, self.cfg.num_layers))

    def tail(weights, hidden, targets, microbatch):
      key = None if head_key is None else jax.random.fold_in(head_key, microbatch)
      head = self._head(None if call is None else call.for_layer(key), weights['head'])
      hidden = nnx.merge(norm_graph, weights['norm'])(hidden)
      return token_losses(head, hidden, targets, self.cfg.loss_chunk).sum()

    # The weights' logical axes, for the pipeline to place what it keeps of them.
    table_axes = PartitionSpec(*self.embedding.out_sharding)
    embed_axes = {'table': table_axes}
    if self.positions is not None:
      embed_axes['positions'] = PartitionSpec(*self.positions.out_sharding)
    head_axes = (table_axes if self.cfg.tie_embeddings
                 else logical_specs(nnx.split(self.head)[1]))
    tail_axes = {'norm': logical_specs(norm_weights), 'head': head_axes}
    return stack.loss_sum(layer, layers, keys, rows,
                          embed=(embed, self._embed_weights(), embed_rows),
                          tail=(tail, {'norm': norm_weights, 'head': self._head_weights()}),
                          targets=targets,
                          axes=(logical_specs(layers), embed_axes, tail_axes))

  def hidden(self, tokens: jax.Array, positions: jax.Array | None = None, *,
             segments: jax.Array | None = None, dropout_key: jax.Array | None = None,
             reference: bool = False, stack: 'Stack | None' = None):
    """The final norm's output [batch, length, d_model] (the batch twice with `reference`), and
    the head: a function of such hidden states (any number of positions) to fp32 logits.
    `segments` [batch, length] int: packed rows, a document id per position (0: padding); each
    position attends only within its document, and positions (rotary or learned) default to the
    index within the document. `stack` runs the block stack (default `scan_layers`; a pipeline is
    another). Under context parallelism the hidden states come in zigzag order (models/context.py:
    `__call__` and `token_losses` put what they return back in sequence order)."""
    x, layer, layers, layer_keys, row_inputs, call = self._stack_inputs(
        tokens, positions, segments, dropout_key, reference)
    stack = stack or functools.partial(scan_layers, unroll=self.cfg.scan_unroll)
    x = self.final_norm(stack(layer, layers, x, layer_keys, row_inputs))

    head_call = None if call is None else call.for_layer(
        None if dropout_key is None else jax.random.fold_in(dropout_key, self.cfg.num_layers))
    return x, self._head(head_call)

  def _stack_inputs(self, tokens, positions, segments, dropout_key, reference=False, embed=True):
    """What a Stack is given: (the first block's input (None unless `embed`), `layer`, the
    stacked `layers`, their dropout keys, the per-row inputs), and the adapters' call (None: no
    dropout, no reference)."""
    cfg = self.cfg
    tokens, positions, segments, _ = self._in_context_order(tokens, positions, segments)
    rows = tokens.shape[0]
    active_rows = None
    if reference:   # the batch twice: adapters on for the first copy, off for the second
      tokens = jnp.concatenate([tokens, tokens])
      positions = positions if positions.shape[0] == 1 else jnp.concatenate([positions, positions])
      segments = None if segments is None else jnp.concatenate([segments, segments])
      active_rows = jnp.arange(2 * rows) < rows
    x = self._embed_tokens(self._embed_weights(), tokens, positions) if embed else None
    cos, sin = self._rope(positions)
    row_inputs = None   # what a stack that splits the batch must split with x
    if segments is not None:
      row_inputs = {'segments': segments}
      if cos is not None:
        row_inputs.update({name: jnp.broadcast_to(table, tokens.shape + table.shape[2:])
                           for name, table in (('cos', cos), ('sin', sin))})

    call = (AdapterCall(None, active_rows)
            if dropout_key is not None or active_rows is not None else None)
    layer_keys = (jax.random.split(dropout_key, cfg.num_layers)
                  if dropout_key is not None else None)
    graphdef, layers = nnx.split(self.blocks)
    # Rolled, the forward and the backward's recomputation sit in two loops, out of CSE's reach.
    # Unrolled, or one layer (XLA drops a loop of one trip), they meet in one computation, where
    # XLA:GPU merges the recomputation into the forward unless told not to: the 1b step with remat
    # full, unrolled and compiled for an H200, kept what remat none then held, 46.55 GiB (30.83
    # rolled).
    meets_forward = cfg.scan_unroll > 1 or cfg.num_layers == 1
    # Without remat the backward casts each layer's stored weights again (models/dense.py); off
    # the CPU only, as SwiGLU's and the norm's: XLA:CPU keeps the program its figures are
    # calibrated on.
    casts = (functools.partial(weight_casts_recomputed, prevent_cse=meets_forward)
             if cfg.remat == 'none' and compile_platform() != 'cpu' else contextlib.nullcontext)

    def layer(x, params, key, rows):
      """One block, a plain function of its (unstacked) weights, on the rows `rows` describes."""
      x = checkpoint_name(x, 'block_input')
      # A base in host memory streams in a layer at a time (as the scan slices it).
      block = nnx.merge(graphdef, weights_on_device(params))
      adapters = None if call is None else call.for_layer(key)
      with casts():
        if rows is None:
          return block(x, cos, sin, adapters)
        return block(x, rows.get('cos'), rows.get('sin'), adapters, rows['segments'])

    if cfg.remat != 'none':
      layer = jax.checkpoint(layer, policy=_REMAT[cfg.remat], prevent_cse=meets_forward)
    return x, layer, layers, layer_keys, row_inputs, call

  def _context_order(self, length: int):
    """The zigzag order of a sequence split over context shards (models/context.py), or None."""
    shards = sequence_shards()
    return None if shards == 1 else zigzag_order(length, shards)

  def _in_context_order(self, tokens, positions, segments, targets=None):
    """tokens, positions (default: each one's index in its segment, or in the row: one row for
    all, whose tables broadcast over any split of the batch), segments and targets in the order
    the blocks run them: the sequence's, or zigzag under context parallelism."""
    if positions is None:
      positions = (jnp.arange(tokens.shape[1])[None] if segments is None
                   else segment_positions(segments))
    order = self._context_order(tokens.shape[1])
    return tuple(to_zigzag(x, order) for x in (tokens, positions, segments, targets))

  def _embed(self, tokens: jax.Array, positions: jax.Array):
    """The input of the first block [batch, length, d_model], and the rotary tables (None with
    learned positions, which are added here)."""
    return self._embed_tokens(self._embed_weights(), tokens, positions), *self._rope(positions)

  def _rope(self, positions: jax.Array):
    """The rotary tables (cos, sin) of `positions`, or (None, None) with learned positions."""
    if self.positions is not None:
      return None, None
    return rope_tables(positions, self.cfg.head_dim, self.cfg.rope_theta, scaling=self.cfg)

  def _embed_weights(self) -> dict:
    """What `_embed_tokens` reads: the table, and GPT-2's learned positions."""
    weights = {'table': self.embedding[...]}
    if self.positions is not None:
      weights['positions'] = self.positions[...]
    return weights

  @jax.named_scope('embed')
  def _embed_tokens(self, weights: dict, tokens: jax.Array, positions: jax.Array) -> jax.Array:
    """tokens [batch, length] -> the first block's input [batch, length, d_model], a plain
    function of `_embed_weights`."""
    dtype = self.policy.compute_dtype
    # Vocabulary-parallel lookup: the table keeps its vocab split (over `tensor`) and is gathered
    # over any other axis first; left to itself XLA may copy the whole table to every device.
    table = constrain(weights['table'], ('vocab', None))
    x = jnp.take(table, tokens, axis=0).astype(dtype)
    if 'positions' in weights:
      x = x + jnp.take(weights['positions'], positions, axis=0).astype(dtype)
    return constrain(x, ('batch', 'length', 'embed'))

  # ---- generation with a key/value cache ------------------------------------------------------
  def new_cache(self, rows: int, length: int) -> tuple[jax.Array, jax.Array]:
    """Empty keys and values for `rows` sequences of up to `length` positions, laid out on the
    scanned layer axis like the weights: [layers, rows, length, kv_heads, head_dim] each."""
    cfg = self.cfg
    shape = (cfg.num_layers, rows, length, cfg.num_kv_heads, cfg.head_dim)
    return (jnp.zeros(shape, self.policy.compute_dtype),) * 2

  def extend(self, tokens: jax.Array, start: jax.Array, cache: tuple[jax.Array, jax.Array]):
    """Run `tokens` [rows, t] (row r at positions start[r] + 0..t-1) through the model, reading
    and writing `cache`: a prompt from position 0 (t >= 1, start 0), or one next token per row
    (t == 1). Returns (fp32 logits [rows, t, vocab], cache)."""
    positions = start[:, None] + jnp.arange(tokens.shape[1])
    x, cos, sin = self._embed(tokens, positions)

    def body(x, block, layer_cache):
      return block.with_cache(x, cos, sin, layer_cache, start)

    run_blocks = nnx.scan(body, in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0),
                          transform_metadata={nnx.PARTITION_NAME: 'layers'})
    x, cache = run_blocks(x, self.blocks, cache)
    return self._head(None)(self.final_norm(x)), cache

  def _head_weights(self):
    """What `_head` reads: the embedding table (tied), or the head's weights."""
    return self.embedding[...] if self.cfg.tie_embeddings else nnx.split(self.head)[1]

  def _head(self, call: AdapterCall | None, weights=None):
    """hidden [batch, n, d_model] -> fp32 logits [batch, n, vocab], as a plain function of arrays
    (its weights are read here), so that a scan over chunks of positions can run it. The product
    runs in the compute dtype and accumulates into fp32 logits: they are never rounded to 16 bits
    (a bf16 logit has 8 significant bits: at a logit of 16 it moves in steps of 1/8 nat)."""
    dtype = self.policy.compute_dtype
    weights = self._head_weights() if weights is None else weights
    if self.cfg.tie_embeddings:
      table = weights.astype(dtype)
      project = lambda x: jnp.einsum('bld,vd->blv', x, table, preferred_element_type=jnp.float32)
      if head_gradient_rounded(dtype):
        project = lambda x: wide_product(x, table, TIED_HEAD_DIMS)
    else:
      graphdef = nnx.graphdef(self.head)
      project = lambda x: nnx.merge(graphdef, weights)(x, call)
    return lambda x: constrain(project(x).astype(jnp.float32), ('batch', 'length', 'vocab'))
