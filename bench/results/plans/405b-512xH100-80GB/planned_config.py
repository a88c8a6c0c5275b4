"""Planned on 2026-11-25 by
  python main.py --config=configs/fsdp.py:405b --plan --target=512xH100-80GB --workdir=/tmp/w/plan-405b

bf16_master, Adam 32-bit, ZeRO-3, tensor 8, remat full, 8 microbatch(es)
on 512xH100-80GB: compiled 71.9 GB per device (estimate 72.0 GB; usable 72.0 GB), estimated 51.11 s per step, 41,036 tokens/s.

Run it on the target:  python main.py --config=/tmp/w/plan-405b/planned_config.py
Size it here:          python main.py --config=/tmp/w/plan-405b/planned_config.py --dry_run --host_devices=512
"""
import ml_collections

CONFIG = {'compile_cache': '~/.cache/less-memory-lm/jax',
 'data': {'packing': True, 'path': '', 'tokenizer': 'bytes', 'val_fraction': 0.05},
 'description': 'ZeRO-3 / FSDP: parameters sharded too',
 'host_devices': 0,
 'init_from': '',
 'lora': {'alpha': 16.0, 'dropout': 0.0, 'rank': 0, 'targets': '.*attention/(query|value)'},
 'mesh': {'data': 1, 'fsdp': 64, 'stage': 1, 'tensor': 8},
 'model': {'attention': 'auto',
           'bias': False,
           'd_model': 16384,
           'head_dim': 128,
           'init_std': 0.02,
           'loss_chunk': 0,
           'max_seq_len': 8192,
           'mlp': 'swiglu',
           'mlp_dim': 53248,
           'norm': 'rms',
           'norm_eps': 1e-05,
           'num_heads': 128,
           'num_kv_heads': 8,
           'num_layers': 126,
           'positions': 'rope',
           'remat': 'full',
           'rope_factor': 8.0,
           'rope_high_freq_factor': 4.0,
           'rope_low_freq_factor': 1.0,
           'rope_original_max_len': 8192,
           'rope_scaling': 'llama3',
           'rope_theta': 500000.0,
           'scan_unroll': 1,
           'tie_embeddings': False,
           'vocab_size': 128256},
 'name': 'planned:fsdp:405b@512xH100-80GB',
 'parallel': {'pipeline_microbatches': 1,
              'pipeline_repeats': 1,
              'pipeline_schedule': 'gpipe',
              'zero_stage': 3},
 'precision': 'bf16_master',
 'quant': {'adam_bits': 32,
           'adam_block_size': 2048,
           'amax_history': 16,
           'block_size': 0,
           'fp8_scaling': 'current',
           'int8_backward': False,
           'learned_scale': False,
           'mode': 'none',
           'threshold': 6.0,
           'weights': 'none'},
 'sample': {'length': 200, 'prompt': 'def ', 'temperature': 0.8},
 'train': {'b1': 0.9,
           'b2': 0.95,
           'batch_size': 512,
           'checkpoint_every': 5000,
           'checkpoint_minutes': 0.0,
           'eval_every': 5000,
           'eval_tokens': 1048576,
           'grad_clip': 1.0,
           'keep_checkpoints': 3,
           'learning_rate': 8e-05,
           'log_every': 10,
           'max_bad_steps': 5,
           'microbatches': 8,
           'min_lr_ratio': 0.1,
           'seed': 0,
           'seq_len': 4096,
           'steps': 10000,
           'warmup_steps': 500,
           'weight_decay': 0.1}}


def get_config(preset=None):
  del preset   # the plan fixed the model
  return ml_collections.ConfigDict(CONFIG)
