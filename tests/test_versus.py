"""bench/versus.py's programs: the PyTorch loop (bench/eager_torch.py) compiled trains as its eager
twin, its bf16_mixed mode keeps fp32 weights and state while its matmuls run bf16, and the compared
models (PyTorch's, ours, the 1b preset) have the same parameters. Skipped where torch is not
installed (the jax 0.11/0.12 stacks)."""
import pytest

torch = pytest.importorskip('torch')

from bench import eager_torch  # noqa: E402
from bench.shapes import SHAPES, our_config  # noqa: E402

TINY = dict(vocab_size=64, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8,
            mlp_dim=64, tie_embeddings=True, batch_size=2, seq_len=16)


def test_the_compiled_loop_trains_as_the_eager_one():
  """Three steps from the same weights and tokens: equal losses, to fp32's summation order (the
  logits are sums of 32 products; Adam's first steps move each weight by about the learning rate,
  whatever the gradient's size, so a reordered sum does not grow through them)."""
  spec = {**TINY, 'precision': 'fp32'}
  eager = eager_torch.Trainer(spec, threads=2)
  compiled = eager_torch.Trainer(spec, threads=2, compiled=True)
  for _ in range(3):
    eager.run(1)
    compiled.run(1)
    assert compiled.loss == pytest.approx(eager.loss, abs=1e-5)


def test_bf16_mixed_keeps_fp32_weights_and_state_and_multiplies_in_bf16():
  trainer = eager_torch.Trainer({**TINY, 'precision': 'bf16_mixed'}, threads=2)
  seen = []
  trainer.model.blocks[0].gate.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
  trainer.run(2)
  assert seen == [torch.bfloat16, torch.bfloat16]
  assert {p.dtype for p in trainer.model.parameters()} == {torch.float32}
  moments = [s['exp_avg'].dtype for s in trainer.optimizer.state.values()]
  assert moments and set(moments) == {torch.float32}

  pure = eager_torch.Trainer({**TINY, 'precision': 'bf16'}, threads=2)
  assert {p.dtype for p in pure.model.parameters()} == {torch.bfloat16}


def test_a_precision_or_device_the_loop_does_not_run_is_named():
  with pytest.raises(ValueError, match=r"precision='fp8'.*fp32, bf16, bf16_mixed"):
    eager_torch.Trainer({**TINY, 'precision': 'fp8'}, threads=2)
  with pytest.raises(ValueError, match=r"device='tpu'.*cpu or cuda"):
    eager_torch.Trainer({**TINY, 'precision': 'fp32'}, threads=2, device='tpu')


def test_the_compared_1b_models_are_the_1b_preset():
  """PyTorch's model (built on the meta device: nothing allocated), ours as bench.versus configures
  it, and configs/presets.py's 1b: the same 1,235,814,400 parameters."""
  from configs import presets
  from models.config import ModelConfig
  from train.checks import model_config
  spec = {**SHAPES['1b'], 'precision': 'bf16_mixed', 'ours_precision': 'bf16_mixed',
          'packing': False, 'attention': 'auto', 'overrides': []}
  with torch.device('meta'):
    theirs = sum(p.numel() for p in eager_torch.Transformer({**spec}).parameters())
  ours = model_config(our_config(spec)).num_params
  preset = ModelConfig(**presets.model('1b')).num_params
  assert theirs == ours == preset == 1_235_814_400
