"""Text generation from prompts, with a key/value cache.

The prompts (a batch, of different lengths) run through the model once, filling each layer's keys
and values (`Transformer.extend`); then each step runs one new token per row against that cache.
Both are inside one jitted program, compiled once per batch shape. A row's prompt is padded at
its end; the padding's cache entries lie after the row's own position, where the causal mask
hides them, and the row's next tokens overwrite them in turn.
"""
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models.llama import weights_on_device


def generate_batch(graphdef, params, prompts: list, *, num_tokens: int, window: int,
                   temperature: float, seed: int, vocab_limit: int | None = None,
                   frozen=None, model_shapes=None, top_k: int = 0, top_p: float = 1.0,
                   timing: dict | None = None) -> list[np.ndarray]:
  """Each prompt followed by its sampled tokens, `num_tokens` of them or fewer where the
  `window` (the cache's length in positions) fills. `temperature` 0 is greedy; above it, the
  tokens are drawn from the `top_k` most likely (0: all) within the smallest set whose
  probability reaches `top_p` (1: all). `frozen`: the base weights of a LoRA model.
  `vocab_limit`: sample only ids below it (a model whose vocabulary is larger than the
  tokenizer's). `model_shapes`: the true shapes of (params, frozen) where a train state stores
  them padded (train/state.py:StateLayout.model_shapes). `timing`: a dict that gets the compile's
  and the run's seconds (`compile_s`, `run_s`) and the tokens generated (`new_tokens`)."""
  prompts = [np.asarray(p, np.int32)[-(window - 1):] for p in prompts]
  if any(len(p) == 0 for p in prompts):
    raise ValueError('every prompt needs at least one token')
  lengths = np.array([len(p) for p in prompts], np.int32)
  steps = int(min(num_tokens, window - lengths.max()))
  padded = np.zeros((len(prompts), int(lengths.max())), np.int32)
  for row, p in enumerate(prompts):
    padded[row, :len(p)] = p
  if not isinstance(top_k, int) or top_k < 0 or not 0 < top_p <= 1:
    raise ValueError(f'top_k={top_k!r} must be an integer >= 0 (0: all) and top_p={top_p!r} in '
                     '(0, 1] (1: all)')
  args = (graphdef, params, {} if frozen is None else frozen, jnp.asarray(padded),
          jnp.asarray(lengths), jax.random.key(seed))
  static = dict(steps=steps, window=window, temperature=float(temperature),
                vocab_limit=vocab_limit, model_shapes=model_shapes, top_k=top_k,
                top_p=float(top_p))
  if timing is None:   # jit's cache: a second call of the same shapes compiles nothing
    tokens = np.asarray(jax.device_get(_run(*args, **static)))
  else:   # compiled ahead, so that the run's time is the generation's alone
    started = time.perf_counter()
    compiled = _run.lower(*args, **static).compile()
    compiled_at = time.perf_counter()
    tokens = np.asarray(jax.device_get(compiled(*args[1:])))
    timing.update(compile_s=compiled_at - started, run_s=time.perf_counter() - compiled_at,
                  new_tokens=int(tokens.size))
  return [np.concatenate([p, tokens[row]]) for row, p in enumerate(prompts)]


def generate(graphdef, params, prompt, **kwargs) -> np.ndarray:
  """One prompt (generate_batch's arguments): the prompt followed by its sampled tokens."""
  return generate_batch(graphdef, params, [prompt], **kwargs)[0]


def truncated(logits: jax.Array, top_k: int, top_p: float) -> jax.Array:
  """`logits` [rows, vocabulary] with every token outside the `top_k` most likely (0: none left
  out) and outside the smallest set of most likely tokens whose probability reaches `top_p` set to
  -inf (the most likely token always stays)."""
  if top_k and top_k < logits.shape[-1]:
    kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
    logits = jnp.where(logits < kth, -jnp.inf, logits)
  if top_p < 1:
    descending = jnp.sort(logits, axis=-1)[:, ::-1]
    probs = jax.nn.softmax(descending, axis=-1)
    before = jnp.cumsum(probs, axis=-1) - probs   # the probability of the tokens above each
    kept = jnp.where(before < top_p, descending, jnp.inf).min(axis=-1, keepdims=True)
    logits = jnp.where(logits < kept, -jnp.inf, logits)
  return logits


@functools.partial(jax.jit, static_argnames=('graphdef', 'steps', 'window', 'temperature',
                                             'vocab_limit', 'model_shapes', 'top_k', 'top_p'))
def _run(graphdef, params, frozen, prompts, lengths, key, *, steps, window, temperature,
         vocab_limit, model_shapes, top_k, top_p):
  """[rows, steps] tokens after each row's prompt (rows padded to one length)."""
  # A frozen base in host memory (parallel.offload_frozen) comes to the device for sampling.
  frozen = weights_on_device(frozen)
  if model_shapes is not None:
    params, frozen = model_shapes[0].fit(params), model_shapes[1].fit(frozen)

  def pick(logits, key):
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None:
      logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    if temperature == 0:
      return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return jax.random.categorical(key, truncated(logits / temperature, top_k, top_p)).astype(
        jnp.int32)

  rows = prompts.shape[0]
  model = nnx.merge(graphdef, params, frozen)
  cache = model.new_cache(rows, window)
  logits, cache = model.extend(prompts, jnp.zeros((rows,), jnp.int32), cache)
  last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
  keys = jax.random.split(key, max(steps, 1))
  out = jnp.zeros((rows, steps), jnp.int32)
  if steps == 0:
    return out

  def step(i, carry):
    # The weights travel in the carry: an NNX model is built from values of the loop's own trace.
    weights, out, cache, token = carry
    out = out.at[:, i].set(token)
    logits, cache = nnx.merge(graphdef, *weights).extend(token[:, None], lengths + i, cache)
    return weights, out, cache, pick(logits[:, 0], keys[i + 1])

  _, out, _, token = jax.lax.fori_loop(0, steps - 1, step,
                                       ((params, frozen), out, cache, pick(last, keys[0])))
  return out.at[:, steps - 1].set(token)
