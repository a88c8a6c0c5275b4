"""The memory of creating a fresh run's state (train/init_from.py:creation_bytes), which the dry run
reports beside the step's and the planner counts: compiled, per device, as a run creates it."""
import json
import os

import jax

from configs import default, finetune
from configs.layouts import layout_config
from memory.compiled import compiled_memory
from train import init_from, run

# Wide enough that a whole-stack draw outweighs one layer's (the test_buffers shape).
WIDE = {'model.d_model': 256, 'model.mlp_dim': 1024, 'model.num_heads': 8, 'model.num_kv_heads': 4,
        'model.head_dim': 32, 'model.num_layers': 8, 'train.batch_size': 8, 'train.seq_len': 16,
        'compile_cache': ''}


def _config(config, **overrides):
  for key, value in {**WIDE, **overrides}.items():
    default.override(config, key, value)
  return config


def test_a_fresh_state_is_the_initialisers_compiled_outputs_and_temporaries(tmp_path):
  config = _config(layout_config('fsdp', 'tiny'))
  memory = run.dry_run(config, str(tmp_path))
  s = run.setup(config)
  compiled = compiled_memory(s.layout.init.lower().compile())
  creation = memory['init_bytes']
  # What one device holds of the state: the initialiser's outputs, shard by shard (XLA rounds a
  # small buffer, a scalar, up to its alignment: at most 64 bytes more per array).
  leaves = len(jax.tree.leaves(s.layout.abstract))
  assert 0 <= compiled['outputs'] - creation['state'] <= 64 * leaves
  assert creation['peak'] == compiled['outputs'] + compiled['temp'] >= creation['state']
  with open(os.path.join(tmp_path, 'memory.json')) as f:
    assert json.load(f)['init_bytes'] == creation


def test_zero3_creates_one_shard_of_the_state_per_device():
  whole = run.setup(_config(layout_config('ddp', 'tiny')))
  sharded = run.setup(_config(layout_config('fsdp', 'tiny')))
  # Over 8 devices every weight (and moment) is split 8 ways but the norm scales' and the step's
  # few bytes; replicated, each device holds it all.
  assert (init_from.creation_bytes(sharded)['state']
          < init_from.creation_bytes(whole)['state'] / 7)


def test_a_random_lora_base_is_created_a_layer_at_a_time():
  config = _config(finetune.finetune_config('lora', 'tiny'), precision='bf16_mixed')
  s = run.setup(config, devices=jax.devices()[:1])
  creation = init_from.creation_bytes(s)
  # Jitted whole, the initialiser draws every layer of the base at once in fp32 before storing it
  # in the compute dtype; drawn layer by layer, at most one layer's fp32 values exist beside the
  # state.
  whole = compiled_memory(s.layout.init.lower().compile())
  assert creation['state'] <= creation['peak'] < whole['outputs'] + whole['temp']
  layer_fp32 = 4 * (256 * 1024)   # the largest kernel of one layer, in fp32
  assert creation['peak'] <= creation['state'] + 4 * layer_fp32
