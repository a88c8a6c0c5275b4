"""Fine-tuning from a checkpoint (`init_from`): a Hugging Face checkpoint or an earlier run loads
into the state sharded on the mesh (quantized on load for QLoRA), a LoRA run exports merged to a
checkpoint transformers reads with the same logits, and a bad source is one line before any write."""
import json
import os

import jax
import numpy as np
import pytest
from flax import nnx, traverse_util

try:   # the reference: requirements-test.txt has them; a stack without them skips what needs them
  import torch
  from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
except ImportError:
  torch = None

from configs import finetune
from convert import HFCheckpoint
from quant.weights import quantize_parts
from tests.helpers import random_tokens, tiny_config
from train import checks, init_from, run
from train.export_hf import export_run, merged_params
from train.ptq import restore_weights

needs_torch = pytest.mark.skipif(torch is None,
                                 reason='needs torch and transformers (requirements-test.txt)')
TINY_HF = dict(vocab_size=256, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rope_theta=10000.0, tie_word_embeddings=False)


@pytest.fixture(scope='module')
def hf_dir(tmp_path_factory):
  if torch is None:
    pytest.skip('needs torch and transformers (requirements-test.txt)')
  torch.manual_seed(0)
  directory = str(tmp_path_factory.mktemp('llama'))
  LlamaForCausalLM(LlamaConfig(**TINY_HF)).save_pretrained(directory)
  return directory


def _setup(config, devices=8):
  source = run._open_source(config)
  return run.setup(config, devices=jax.devices()[:devices]), source


def _leaves_equal(a, b):
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_full_fine_tuning_loads_every_weight_sharded_under_zero3(hf_dir):
  config = tiny_config(**{'init_from': f'hf:{hf_dir}', 'mesh.data': 1, 'mesh.fsdp': 8,
                          'parallel.zero_stage': 3})
  s, source = _setup(config)
  assert config.model.tie_embeddings is False and config.model.mlp_dim == 192   # the source's shape
  state = init_from.initial_state(s, source)
  expected = HFCheckpoint(hf_dir).read_all(s.layout.abstract['params'])
  _leaves_equal(state['params'], expected)
  kernel = state['params']['blocks']['mlp']['up']['kernel']
  assert kernel.sharding == s.layout.shardings['params']['blocks']['mlp']['up']['kernel']
  assert kernel.addressable_shards[0].data.size * 8 == kernel.size


def test_a_hugging_face_checkpoint_loads_into_a_mesh_that_pads_d_model(hf_dir):
  """hidden_size 64 over 3 devices: stored padded to 66 (parallel/padding.py), the true weights
  the checkpoint's, the padding zeros."""
  config = tiny_config(**{'init_from': f'hf:{hf_dir}', 'mesh.data': 1, 'mesh.fsdp': 3,
                          'parallel.zero_stage': 3, 'train.batch_size': 6})
  s, source = _setup(config, devices=3)
  one, _ = _setup(tiny_config(**{'init_from': f'hf:{hf_dir}'}), devices=1)
  state = init_from.initial_state(s, source)
  expected = traverse_util.flatten_dict(HFCheckpoint(hf_dir).read_all(one.layout.abstract['params']))
  padded = 0
  for path, held in traverse_util.flatten_dict(state['params']).items():
    held = np.asarray(held)
    true = tuple(slice(0, n) for n in expected[path].shape)
    np.testing.assert_array_equal(held[true], expected[path])
    assert np.count_nonzero(held) == np.count_nonzero(held[true])
    padded += held.shape != expected[path].shape
  assert padded


def test_what_depends_on_the_weights_is_made_from_the_loaded_ones(hf_dir):
  """An fp32 master (bf16_master) starts as the loaded weights, and LSQ step sizes as 2 mean|w| /
  sqrt(7) of each loaded kernel's output channel, not of the random kernel they replace."""
  from optim.master import master_weights
  from quant import lsq
  config = tiny_config(**{'init_from': f'hf:{hf_dir}', 'precision': 'bf16_master',
                          'quant.mode': 'int4', 'quant.learned_scale': True, 'mesh.data': 1,
                          'mesh.fsdp': 8, 'parallel.zero_stage': 1})
  s, source = _setup(config)
  state = init_from.initial_state(s, source)
  params = state['params']
  master = master_weights(state['opt_state'])
  for w, m in zip(jax.tree.leaves(params), jax.tree.leaves(master)):
    np.testing.assert_array_equal(np.asarray(w, np.float32), np.asarray(m))
  kernel = np.asarray(params['blocks']['mlp']['down']['kernel'], np.float32)   # [layers, mlp, embed]
  expected = np.stack([np.asarray(lsq.initial_step_size(k, 1, bits=4)) for k in kernel])
  np.testing.assert_allclose(params['blocks']['mlp']['down']['step_size'], expected, rtol=1e-6)
  random = s.layout.init()['params']['blocks']['mlp']['down']['step_size']
  assert not np.allclose(random, expected)


def test_qlora_quantizes_on_load_into_the_sharded_base(hf_dir):
  config = finetune.finetune_config('qlora', 'tiny')
  config.init_from = f'hf:{hf_dir}'
  s, source = _setup(config)
  state = init_from.initial_state(s, source)
  frozen = state['frozen']
  up = frozen['blocks']['mlp']['up']['kernel']
  assert set(up) == {'codes', 'scale', 'scale_scale', 'scale_mean'}
  assert up['codes'].addressable_shards[0].data.size * 8 == up['codes'].size
  # The same parts as quantizing the (bf16-rounded) float kernel on one device.
  float_up = HFCheckpoint(hf_dir).read(('blocks', 'mlp', 'up', 'kernel'), (2, 64, 192),
                                       jax.numpy.bfloat16)
  quantize = jax.jit(quantize_parts, static_argnums=(1, 2, 3))   # one compile, not one per op
  _leaves_equal(up, quantize(jax.numpy.asarray(float_up), 'nf4', 1, True))
  assert 'lora' in state['params']['blocks']['attention']['query']


@needs_torch
def test_lora_from_an_earlier_run_starts_from_its_weights_and_exports_merged(tmp_path):
  base_dir, tuned_dir = str(tmp_path / 'base'), str(tmp_path / 'tuned')
  run.train_and_evaluate(tiny_config(**{'train.steps': 2}), base_dir)
  config = tiny_config(**{'train.steps': 4, 'init_from': f'run:{base_dir}', 'lora.rank': 4,
                          'lora.alpha': 64.0, 'train.learning_rate': 1e-2})
  run.train_and_evaluate(config, tuned_dir)
  base_params, _ = restore_weights(base_dir, tiny_config())
  params, frozen = restore_weights(tuned_dir, config)
  _leaves_equal(frozen, base_params)   # fp32 policy: the frozen base is the run's, bit for bit
  b = params['blocks']['attention']['query']['lora']['b']
  assert np.abs(np.asarray(b)).max() > 0   # the adapters trained

  # Export merged; transformers computes what our adapted model computes.
  out = str(tmp_path / 'hf')
  export_run(tuned_dir, out)
  spec = checks.model_spec(config)
  graphdef = nnx.split(spec.abstract(), spec.trainable, ...)[0]
  tokens = random_tokens((2, 32))
  ours = np.asarray(nnx.merge(graphdef, params, frozen)(tokens))
  hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
  with torch.no_grad():
    theirs = hf(torch.from_numpy(tokens).long()).logits.numpy()
  assert np.abs(ours - theirs).max() / np.abs(theirs).max() < 1e-4
  assert 'lora' not in json.dumps(jax.tree.map(lambda x: None, merged_params(config, params,
                                                                            frozen)))


def test_qlora_dry_run_needs_no_checkpoint(tmp_path):
  memory = run.dry_run(finetune.finetune_config('qlora', 'tiny'), str(tmp_path / 'dry'))
  assert memory['trainable_params'] < memory['num_params'] / 10
  assert memory['frozen_bytes'] > 0


@pytest.mark.parametrize('init, message', [
    ('weights.bin', 'init_from=\'weights.bin\'; allowed: "" .random., "hf:DIR"'),
    ('hf:/no/such/dir', '/no/such/dir is not a directory'),
    ('run:/no/such/run', 'no config.json and checkpoints/ there'),
])
def test_a_bad_source_is_refused_before_anything_is_written(tmp_path, init, message):
  workdir = tmp_path / 'run'
  with pytest.raises(init_from.InitError, match=message):
    run.train_and_evaluate(tiny_config(**{'init_from': init}), str(workdir))
  assert not workdir.exists()


def test_tensors_that_disagree_with_config_json_are_named_before_any_write(hf_dir, tmp_path):
  broken = tmp_path / 'broken'
  broken.mkdir()
  for name in os.listdir(hf_dir):
    os.symlink(os.path.join(hf_dir, name), broken / name)
  os.remove(broken / 'config.json')
  hf_config = json.load(open(os.path.join(hf_dir, 'config.json')))
  (broken / 'config.json').write_text(json.dumps({**hf_config, 'intermediate_size': 256}))
  workdir = tmp_path / 'run'
  with pytest.raises(init_from.InitError, match=r"tensor 'model.layers.0.mlp.down_proj.weight' in "
                     r".*has shape \(64, 192\); .*config.json expects \(64, 256\)"):
    run.train_and_evaluate(tiny_config(**{'init_from': f'hf:{broken}'}), str(workdir))
  assert not workdir.exists()


def test_a_lora_run_is_not_a_base_to_start_from(tmp_path):
  lora_dir = tmp_path / 'lora'
  run.train_and_evaluate(tiny_config(**{'train.steps': 1, 'lora.rank': 2}), str(lora_dir))
  with pytest.raises(init_from.InitError, match='is a LoRA run'):
    run.train_and_evaluate(tiny_config(**{'init_from': f'run:{lora_dir}'}), str(tmp_path / 'x'))


@needs_torch
def test_fine_tuning_an_imported_model_on_its_own_tokenizer(tmp_path):
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  text_dir = tmp_path / 'text'
  text_dir.mkdir()
  for i in range(6):
    (text_dir / f'doc{i}.txt').write_text(f'def function_{i}(value):\n    return value * {i}\n' * 40)
  tokenizer = Tokenizer(models.BPE())
  tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tokenizer.decoder = decoders.ByteLevel()
  tokenizer.train_from_iterator(
      [p.read_text() for p in text_dir.iterdir()],
      trainers.BpeTrainer(vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
  checkpoint = tmp_path / 'hf'
  torch.manual_seed(0)
  vocab = tokenizer.get_vocab_size()
  LlamaForCausalLM(LlamaConfig(**{**TINY_HF, 'vocab_size': vocab})).save_pretrained(checkpoint)
  tokenizer.save(str(checkpoint / 'tokenizer.json'))

  config = tiny_config(**{'init_from': f'hf:{checkpoint}', 'data.tokenizer': str(checkpoint),
                          'data.path': str(text_dir / '*.txt'), 'data.val_fraction': 0.5,
                          'lora.rank': 4, 'train.steps': 2, 'train.seq_len': 32})
  run.train_and_evaluate(config, str(tmp_path / 'run'))
  rows = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
  last = [r for r in rows if 'eval_loss' in r][-1]
  # BPE tokens hold several bytes each: bits per byte is well below bits per token.
  assert last['eval_bits_per_byte'] < 0.5 * last['eval_loss'] / np.log(2)


def test_a_missing_tokenizer_is_refused_in_one_line(tmp_path):
  from data import DataError
  with pytest.raises(DataError, match='no tokenizer.json there'):
    run.train_and_evaluate(tiny_config(**{'data.tokenizer': str(tmp_path)}), str(tmp_path / 'r'))
  assert not (tmp_path / 'r').exists()


# ---- a random frozen base (LoRA, QLoRA without init_from) -------------------------------------

QLORA = {'lora.rank': 4, 'quant.weights': 'nf4', 'precision': 'bf16_mixed'}


def test_a_random_frozen_base_is_drawn_per_layer_with_each_kernels_init_std():
  config = tiny_config(**{'lora.rank': 4})
  s, _ = _setup(config, devices=1)
  state = init_from.fresh_state(s)
  placed = jax.tree.map(lambda x: (x.shape, x.dtype, x.sharding), state)
  assert placed == jax.tree.map(lambda a: (a.shape, a.dtype, a.sharding), s.layout.abstract)
  whole = s.layout.init()   # the initialiser jitted whole: the same adapters, norms and embedding
  for key in ('params', 'opt_state'):
    _leaves_equal(state[key], whole[key])
  _leaves_equal(state['frozen']['embedding'], whole['frozen']['embedding'])
  _leaves_equal(state['frozen']['blocks']['attention_norm'], whole['frozen']['blocks']['attention_norm'])
  leaves = {leaf.path: leaf for leaf in init_from.base_leaves(s)}
  kernels = [p for p, leaf in leaves.items() if leaf.layer is not None]
  assert len(kernels) == 7   # q, k, v, out, gate, up, down, stacked (tiny ties its head)
  flat = traverse_util.flatten_dict(state['frozen'])
  for path in kernels:
    kernel = np.asarray(flat[path], np.float64)
    layers = kernel if path[0] == 'blocks' else kernel[None]
    std = leaves[path].layer.init_std
    for layer in layers:
      # The sample standard deviation of n normal draws: relative standard error 1/sqrt(2n).
      tolerance = 6 / np.sqrt(2 * layer.size)
      assert abs(layer.std() / std - 1) < tolerance, (path, layer.std(), std)
      assert abs(layer.mean()) < 6 * std / np.sqrt(layer.size)
    if len(layers) > 1:
      assert not np.array_equal(layers[0], layers[1])   # each layer its own draw


@pytest.mark.parametrize('layout', [
    {'mesh.data': 1, 'mesh.fsdp': 8, 'parallel.zero_stage': 3},
    # Two pipeline stages: the layers axis itself is split, each layer written into its stage.
    {'mesh.stage': 2, 'mesh.data': 1, 'mesh.fsdp': 4, 'parallel.zero_stage': 3,
     'parallel.pipeline_microbatches': 2},
])
def test_a_random_quantized_base_is_the_same_on_every_mesh_and_trains(layout):
  one, _ = _setup(tiny_config(**QLORA), devices=1)
  sharded, _ = _setup(tiny_config(**QLORA, **layout))
  a, b = init_from.fresh_state(one), init_from.fresh_state(sharded)
  _leaves_equal(a['frozen'], b['frozen'])
  codes = b['frozen']['blocks']['mlp']['up']['kernel']['codes']
  assert not codes.sharding.is_fully_replicated   # the quantized base is sharded
  batch = {k: jax.device_put(v, sharded.batch_sharding) for k, v in {
      'inputs': random_tokens((8, 64)), 'targets': random_tokens((8, 64), 1),
      'segments': np.ones((8, 64), np.int32)}.items()}
  with sharded.context():
    _, metrics = sharded.train_step(b, batch)
  assert np.isfinite(float(metrics['loss']))


def test_a_random_base_is_never_drawn_whole_in_floats():
  """At the 7B preset a QLoRA base is 3.7 GB of NF4 (the initialiser jitted whole held some 130 GB
  of temporaries on XLA:CPU: bench.studies.init_memory). Drawn by the random source, the rest of
  the state compiles to less than the base, and each layer's quantize-and-write to at most two fp32
  copies of that layer."""
  config = finetune.finetune_config('qlora', '7b')
  config.mesh, config.parallel.zero_stage, config.host_devices = dict(data=1, fsdp=1), 0, 0
  config.train.batch_size, config.train.microbatches = 1, 1
  s, _ = _setup(config, devices=1)
  _, base_bytes = s.spec.sizes()
  leaves = [leaf for leaf in init_from.base_leaves(s) if leaf.layer is not None]
  rest = init_from.rest_initialiser(s, leaves).lower().compile().memory_analysis()
  assert rest.temp_size_in_bytes < base_bytes
  quantized = {leaf.path for leaf in leaves}
  stored = traverse_util.flatten_dict(s.layout.abstract['frozen'],
                                      is_leaf=lambda path, _: path in quantized)
  shardings = traverse_util.flatten_dict(s.layout.shardings['frozen'],
                                         is_leaf=lambda path, _: path in quantized)
  for leaf in leaves:
    store = init_from.storer(leaf, stored[leaf.path], shardings[leaf.path], 'nf4')
    if leaf.path[0] == 'blocks':
      layer = init_from.layer_of(leaf.source)
      args = (stored[leaf.path], layer, np.int32(0))
    else:
      layer = leaf.source
      args = (layer,)
    temp = store.lower(*args).compile().memory_analysis().temp_size_in_bytes
    assert temp <= 2 * 4 * np.prod(layer.shape), (leaf.path, temp)
