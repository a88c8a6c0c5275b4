"""Planned on 2026-11-26 by
  python main.py --config=configs/fsdp.py:7b --plan --target=8xH100-80GB --config.train.seq_len=131072 --config.model.max_seq_len=131072 --config.train.batch_size=8 --workdir=bench/results/plans/7b-128k-8xH100-80GB

bf16_mixed, Adam 8-bit, ZeRO-2, tensor 1, context 4 (ring), remat full, 4 microbatch(es)
on 8xH100-80GB: compiled 68.7 GB per device (estimate 70.1 GB; usable 72.0 GB), estimated 96.53 s per step, 10,863 tokens/s.

Run it on the target:  python main.py --config=bench/results/plans/7b-128k-8xH100-80GB/planned_config.py
Size it here:          python main.py --config=bench/results/plans/7b-128k-8xH100-80GB/planned_config.py --dry_run --host_devices=8
"""
import ml_collections

CONFIG = {'compile_cache': '~/.cache/less-memory-lm/jax',
 'data': {'packing': True, 'path': '', 'tokenizer': 'bytes', 'val_fraction': 0.05},
 'description': 'ZeRO-3 / FSDP: parameters sharded too',
 'host_devices': 0,
 'init_from': '',
 'lora': {'alpha': 16.0, 'dropout': 0.0, 'rank': 0, 'targets': '.*attention/(query|value)'},
 'mesh': {'context': 4, 'data': 1, 'fsdp': 2, 'stage': 1, 'tensor': 1},
 'model': {'attention': 'auto',
           'bias': False,
           'context_attention': 'ring',
           'd_model': 4096,
           'head_dim': 128,
           'init_std': 0.02,
           'loss_chunk': 0,
           'max_seq_len': 131072,
           'mlp': 'swiglu',
           'mlp_dim': 11008,
           'norm': 'rms',
           'norm_eps': 1e-05,
           'num_heads': 32,
           'num_kv_heads': 32,
           'num_layers': 32,
           'positions': 'rope',
           'remat': 'full',
           'rope_factor': 1.0,
           'rope_high_freq_factor': 4.0,
           'rope_low_freq_factor': 1.0,
           'rope_original_max_len': 8192,
           'rope_scaling': 'none',
           'rope_theta': 10000.0,
           'scan_unroll': 1,
           'tie_embeddings': False,
           'vocab_size': 32000},
 'name': 'planned:fsdp:7b@8xH100-80GB',
 'parallel': {'offload_frozen': False,
              'offload_optimizer': False,
              'pipeline_microbatches': 1,
              'pipeline_repeats': 1,
              'pipeline_schedule': 'gpipe',
              'zero_stage': 2},
 'precision': 'bf16_mixed',
 'quant': {'adam_bits': 8,
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
           'batch_size': 8,
           'checkpoint_every': 5000,
           'checkpoint_minutes': 0.0,
           'eval_every': 5000,
           'eval_tokens': 1048576,
           'grad_clip': 1.0,
           'keep_checkpoints': 3,
           'learning_rate': 0.0003,
           'log_every': 10,
           'max_bad_steps': 5,
           'microbatches': 4,
           'min_lr_ratio': 0.1,
           'seed': 0,
           'seq_len': 131072,
           'steps': 10000,
           'warmup_steps': 500,
           'weight_decay': 0.1}}


def get_config(preset=None):
  del preset   # the plan fixed the model
  return ml_collections.ConfigDict(CONFIG)
