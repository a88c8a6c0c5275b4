"""Text generation from a prompt, for a look at what the model learned.

No KV cache: each new token re-runs the model over a fixed-length window. Causality makes the
logit at position t depend only on tokens <= t, so one compiled program serves every step; at the
small shapes this is used for (a few hundred tokens) that costs well under a second.
"""
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


def generate(graphdef, params, prompt: np.ndarray, *, num_tokens: int, window: int,
             temperature: float, seed: int, vocab_limit: int | None = None,
             frozen=None) -> np.ndarray:
  """Returns the prompt followed by up to `num_tokens` sampled tokens (fewer if the window fills).
  `frozen`: the base weights of a LoRA model.

  `vocab_limit`: sample only ids below it (a model whose vocabulary is larger than the tokenizer's)."""
  prompt = np.asarray(prompt, np.int32)[-(window - 1):]
  end = min(window, len(prompt) + num_tokens)

  @jax.jit
  def run(params, frozen, buffer, key):
    def next_token(position, carry):
      buffer, key = carry
      key, sample_key = jax.random.split(key)
      logits = nnx.merge(graphdef, params, frozen)(buffer)[0, position - 1]
      if vocab_limit is not None:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
      if temperature > 0:
        token = jax.random.categorical(sample_key, logits / temperature)
      else:
        token = jnp.argmax(logits)
      return buffer.at[0, position].set(token.astype(buffer.dtype)), key

    buffer, _ = jax.lax.fori_loop(len(prompt), end, next_token, (buffer, key))
    return buffer

  buffer = np.zeros((1, window), np.int32)
  buffer[0, :len(prompt)] = prompt
  out = run(params, {} if frozen is None else frozen, jnp.asarray(buffer),
            jax.random.key(seed))
  return np.asarray(jax.device_get(out))[0, :end]
