"""Generation with the key/value cache: every greedy token is the argmax of a full recompute of the
model over the text so far, for a batch of prompts of different lengths, with rotary and with
learned positions (GPT-2's options)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import presets
from models import ModelConfig, Transformer
from precision.policy import get_policy
from tests.helpers import reordered_rtol
from train.sample import generate, generate_batch

PROMPTS = [[5, 6, 7, 8, 9], [1, 2], [200, 100, 50, 25, 12, 6, 3]]
GPT2 = dict(norm='layer', mlp='gelu', positions='learned', bias=True)


def _model(**fields):
  # A large init scale: an untrained model at 0.02 repeats one token, which tests nothing.
  cfg = ModelConfig(**{**presets.model('tiny'), 'init_std': 0.3, **fields})
  return nnx.split(Transformer(cfg, policy=get_policy('fp32'), rngs=nnx.Rngs(0)))


@pytest.mark.parametrize('fields', [{}, GPT2], ids=['llama', 'gpt2'])
def test_cached_greedy_tokens_are_the_argmax_of_a_full_recompute(fields):
  graphdef, params = _model(**fields)
  window = 40
  outputs = generate_batch(graphdef, params, PROMPTS, num_tokens=30, window=window,
                           temperature=0.0, seed=0)
  full = jax.jit(lambda params, tokens: nnx.merge(graphdef, params)(tokens))
  for prompt, out in zip(PROMPTS, outputs):
    np.testing.assert_array_equal(out[:len(prompt)], prompt)
    assert len(out) == min(len(prompt) + 30, window - max(map(len, PROMPTS)) + len(prompt))
    for i in range(len(prompt), len(out)):
      padded = np.zeros((1, window), np.int32)
      padded[0, :i] = out[:i]
      logits = full(params, jnp.asarray(padded))[0, i - 1]
      # The cached pass sums in another order; a token may differ from the argmax only where
      # the two logits lie within that reordering's rounding of each other.
      top = float(jnp.max(logits))
      assert top - float(logits[out[i]]) <= reordered_rtol(window * 64) * abs(top) + 1e-30, (
          f'position {i}: cached token {out[i]}, full recompute argmax {int(jnp.argmax(logits))}')


def test_sampling_is_reproducible_and_respects_the_vocabulary_limit():
  graphdef, params = _model()
  kwargs = dict(num_tokens=12, window=32, temperature=1.0, vocab_limit=100)
  first = generate(graphdef, params, PROMPTS[0], seed=3, **kwargs)
  np.testing.assert_array_equal(first, generate(graphdef, params, PROMPTS[0], seed=3, **kwargs))
  assert len(first) == len(PROMPTS[0]) + 12 and first[len(PROMPTS[0]):].max() < 100


def test_an_empty_prompt_is_refused():
  graphdef, params = _model()
  with pytest.raises(ValueError, match='at least one token'):
    generate_batch(graphdef, params, [[1], []], num_tokens=2, window=8, temperature=0.0, seed=0)
