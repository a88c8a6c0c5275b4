"""The classic memory table, reproduced from this project's memory model and set beside what its
recipes need per device.

The classic figures (as taught in courses and blog posts on LLM memory): a 1B-parameter model needs
4 GB to store in fp32, 2 GB in bf16/fp16, 1 GB in int8 (0.5 GB in 4 bits), and about 24 GB to train
in fp32 with Adam; 175B needs about 4.2 TB and 500B about 12 TB. Every one of these is a number of
bytes per parameter times the parameter count, and so is every number here. GB and TB are decimal
(1e9, 1e12 bytes), as in the classic figures.

Assumptions, all of them:
- Model shapes are this project's decoder (pre-norm, rotary, SwiGLU, tied embeddings) at the width
  and depth of the models the classic figures name. A SwiGLU MLP of width 8/3 * d_model has the
  parameters (8 d_model^2) of GPT-3's GELU MLP of width 4 * d_model, so a layer is 12 d_model^2
  parameters in both; rotary embeddings replace GPT-3's learned positions (2048 * d_model, under
  0.02 % of either large model).
    1B    a GPT-3-family shape: d_model 2048, 18 layers, 16 heads of 128, MLP 5504, vocabulary
          50304, sequences of 2048;
    175B  GPT-3: d_model 12288, 96 layers, 96 heads of 128, MLP 32768, vocabulary 50304, sequences
          of 2048;
    500B  MT-NLG 530B's width (d_model 20480, 128 heads of 160, MLP 54784, vocabulary 51200,
          sequences of 2048) at 99 layers instead of its 105.
  MLP widths and vocabularies are rounded up (as Megatron pads GPT-2's 50257 to 50304) so that
  every tensor's 8-bit Adam blocks divide over the ZeRO-3 devices; otherwise train/state.py keeps
  that tensor's moments whole on every device, and the 8-bit rows would not show 8-bit Adam.
- Storage is parameters times the format's bytes per value (quant/formats.py): 4 fp32, 2 bf16/fp16,
  1 int8, 0.5 int4/NF4. Like the classic, it leaves out quantization scales (int8 per channel adds
  4 / d_model bytes per weight; NF4 with double-quantized block scales is 0.516 bytes per weight).
- Training, classic: model state from estimate() with the fp32 policy on one device: weights 4 +
  gradients 4 + two Adam moments 8 = 16 bytes/param. Activations and temporaries are the classic's
  own rule, 8 bytes/param ("variable size, high-end estimate"), making 24 bytes/param. The rule is
  taken as stated, not derived: the three classic figures are each 24 bytes/param, while
  activations per parameter fall with width, so no one batch in estimate() gives all three. What
  the rule amounts to in estimate()'s activation term (fp32, no remat, sequences of 2048) is
  reported by `classic_activation_sequences`: about half a sequence for 1B, a few sequences for
  175B and 500B. It is a rule of thumb, not a batch anyone chose.
- Training, this project's recipes: estimate() in full (state, activations and temporaries) per
  device, for one sequence of 2048 tokens per device, no microbatching, full remat (the large
  presets' default), no tensor parallelism. ZeRO-3 runs over DEVICES[model] devices (8 for 1B, 64
  for 175B, 512 for 500B) on the fsdp axis. bf16 mixed keeps fp32 master weights, fp32 gradients and
  fp32 moments (16 bytes/param of state, as the classic) and saves activations; bf16 with 8-bit Adam
  keeps bf16 weights and gradients and blockwise 8-bit moments (2 + 2 + 2 = 6 bytes/param, plus one
  fp32 scale per 2048 values and fp32 moments for the norm scales).
- LoRA and QLoRA are not rows of this table (it keeps the classic's full-training framing); their
  memory at the 1B and 7B presets is measured by `python -m bench.studies.finetune` (WORKSPACE.md).
"""
import dataclasses

from memory.estimate import StepShape, activation_bytes, estimate
from models.config import ModelConfig
from precision.policy import get_policy
from quant.formats import format_rows

GB = 1e9
SEQ_LEN = 2048
CLASSIC_ACTIVATION_BYTES_PER_PARAM = 8

MODELS = {
    '1B': ModelConfig(vocab_size=50304, d_model=2048, num_layers=18, num_heads=16, num_kv_heads=16,
                      head_dim=128, mlp_dim=5504, max_seq_len=SEQ_LEN),
    '175B': ModelConfig(vocab_size=50304, d_model=12288, num_layers=96, num_heads=96,
                        num_kv_heads=96, head_dim=128, mlp_dim=32768, max_seq_len=SEQ_LEN),
    '500B': ModelConfig(vocab_size=51200, d_model=20480, num_layers=99, num_heads=128,
                        num_kv_heads=128, head_dim=160, mlp_dim=54784, max_seq_len=SEQ_LEN),
}
DEVICES = {'1B': 8, '175B': 64, '500B': 512}   # the fsdp axis under ZeRO-3

# The published figures, bytes: storing (fp32, bf16/fp16, int8, 4-bit) and training in fp32 + Adam.
CLASSIC_STORAGE = {'fp32': 4e9, 'bf16 / fp16': 2e9, 'int8': 1e9, 'int4 / NF4': 0.5e9}  # for 1B
CLASSIC_TRAINING = {'1B': 24e9, '175B': 4.2e12, '500B': 12e12}

STORAGE_FORMATS = {'fp32': 'fp32', 'bf16 / fp16': 'bf16', 'int8': 'int8', 'int4 / NF4': 'nf4'}


@dataclasses.dataclass(frozen=True)
class Recipe:
  name: str
  precision: str
  adam_bits: int = 32
  zero3: bool = False      # ZeRO-3 over DEVICES[model]
  classic: bool = False    # activations by the classic rule (8 bytes/param), not by estimate()


RECIPES = (
    Recipe('classic: fp32 + Adam', 'fp32', classic=True),
    Recipe('bf16 mixed', 'bf16_mixed'),
    Recipe('bf16 + 8-bit Adam', 'bf16', adam_bits=8),
    Recipe('bf16 mixed + ZeRO-3', 'bf16_mixed', zero3=True),
    Recipe('bf16 + 8-bit Adam + ZeRO-3', 'bf16', adam_bits=8, zero3=True),
)


@dataclasses.dataclass(frozen=True)
class TrainingRow:
  model: str
  recipe: str
  devices: int          # over which the state is split (1 without ZeRO-3)
  num_params: int
  state: float          # bytes per device: parameters, gradients, optimizer state
  activations: float    # bytes per device: activations and temporaries
  classic_state: float  # the classic recipe's state for this model, bytes
  classic_total: float

  @property
  def total(self) -> float:
    return self.state + self.activations

  @property
  def state_bytes_per_param(self) -> float:
    """Bytes of state per parameter over all devices (16 classic, ~6 with bf16 + 8-bit Adam)."""
    return self.state * self.devices / self.num_params

  @property
  def state_vs_classic(self) -> float:
    return self.state / self.classic_state

  @property
  def total_vs_classic(self) -> float:
    return self.total / self.classic_total


def storage_bytes(cfg: ModelConfig) -> dict[str, float]:
  """Bytes to store the weights in each format (no quantization scales, as the classic)."""
  per_value = {r.name: r.bytes_per_value for r in format_rows()}
  return {label: cfg.num_params * per_value[fmt] for label, fmt in STORAGE_FORMATS.items()}


def step_shape(model: str, recipe: Recipe) -> StepShape:
  devices = DEVICES[model] if recipe.zero3 else 1
  return StepShape(rows_per_device=1, seq_len=SEQ_LEN, fsdp=devices, data_parallel=devices,
                   zero_stage=3 if recipe.zero3 else 0, adam_bits=recipe.adam_bits)


def _state_and_activations(model: str, recipe: Recipe) -> tuple[float, float]:
  cfg = MODELS[model]
  if not recipe.classic:
    cfg = dataclasses.replace(cfg, remat='full')
  parts = estimate(cfg, get_policy(recipe.precision), step_shape(model, recipe))
  state = parts['params'] + parts['grads'] + parts['optimizer']
  if recipe.classic:
    return state, CLASSIC_ACTIVATION_BYTES_PER_PARAM * cfg.num_params
  return state, parts['total'] - state


def training_rows() -> list[TrainingRow]:
  rows = []
  for model, cfg in MODELS.items():
    classic_state, classic_activations = _state_and_activations(model, RECIPES[0])
    for recipe in RECIPES:
      state, activations = _state_and_activations(model, recipe)
      rows.append(TrainingRow(model, recipe.name, DEVICES[model] if recipe.zero3 else 1,
                              cfg.num_params, state, activations, classic_state,
                              classic_state + classic_activations))
  return rows


def classic_activation_sequences(model: str) -> float:
  """The classic's 8 bytes/param of activations as 2048-token sequences of estimate()'s fp32,
  no-remat activations on one device."""
  cfg = dataclasses.replace(MODELS[model], remat='none')
  one = activation_bytes(cfg, get_policy('fp32'), StepShape(rows_per_device=1, seq_len=SEQ_LEN))
  return CLASSIC_ACTIVATION_BYTES_PER_PARAM * cfg.num_params / one
