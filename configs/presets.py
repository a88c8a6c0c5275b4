"""Model-size presets, chosen by the config argument (`configs/default.py:1b`).

Each preset is a model shape plus the training shape it is usually run at. The small ones train on
this machine's CPU; the large ones (Llama shapes) exist for dry runs, planning and GPUs.
"""
MODELS = {
    # For tests: compiles in seconds.
    'tiny': dict(vocab_size=256, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, mlp_dim=192, max_seq_len=256),
    # The CPU default: a byte-level model that learns Python's look in a few minutes on 2 cores.
    'small': dict(vocab_size=256, d_model=256, num_layers=4, num_heads=8, num_kv_heads=4,
                  head_dim=32, mlp_dim=768, max_seq_len=512),
    # ~104M parameters (byte vocabulary).
    '100m': dict(vocab_size=256, d_model=768, num_layers=12, num_heads=12, num_kv_heads=4,
                 head_dim=64, mlp_dim=3072, max_seq_len=1024),
    # Llama-3.2-1B shapes (tied embeddings, 128k vocabulary, its config.json's RoPE scaling).
    '1b': dict(vocab_size=128256, d_model=2048, num_layers=16, num_heads=32, num_kv_heads=8,
               head_dim=64, mlp_dim=8192, max_seq_len=8192, rope_theta=500000.0,
               rope_scaling='llama3', rope_factor=32.0, rope_low_freq_factor=1.0,
               rope_high_freq_factor=4.0, rope_original_max_len=8192),
    # Llama-2-7B shapes.
    '7b': dict(vocab_size=32000, d_model=4096, num_layers=32, num_heads=32, num_kv_heads=32,
               head_dim=128, mlp_dim=11008, max_seq_len=4096, tie_embeddings=False),
    # A Llama-shaped 20B (20.7 B parameters): GPT-NeoX-20B's width (6144) and about its size, with
    # Llama's SwiGLU MLP and 8 KV heads; the model of the "20B on one 24 GB GPU" QLoRA claim.
    '20b': dict(vocab_size=32000, d_model=6144, num_layers=52, num_heads=48, num_kv_heads=8,
                head_dim=128, mlp_dim=16384, max_seq_len=4096, tie_embeddings=False),
    # Llama-2-70B shapes (grouped-query attention, 8 KV heads).
    '70b': dict(vocab_size=32000, d_model=8192, num_layers=80, num_heads=64, num_kv_heads=8,
                head_dim=128, mlp_dim=28672, max_seq_len=4096, tie_embeddings=False),
    # Llama-3-405B (Llama 3.1) shapes: 126 layers, 128 query / 8 KV heads, 128k vocabulary.
    '405b': dict(vocab_size=128256, d_model=16384, num_layers=126, num_heads=128, num_kv_heads=8,
                 head_dim=128, mlp_dim=53248, max_seq_len=8192, tie_embeddings=False,
                 rope_theta=500000.0, rope_scaling='llama3', rope_factor=8.0,
                 rope_low_freq_factor=1.0, rope_high_freq_factor=4.0, rope_original_max_len=8192),
}

# How each preset trains by default: global batch in sequences, sequence length, microbatches,
# steps, peak learning rate, validation tokens, precision and remat. The large presets are set
# for 8 GPUs (70b: 64, 405b: 512):
# bf16 compute with fp32 master weights, full remat, and one sequence per device per microbatch.
# Everything is overridable with --config.*.
TRAIN_SHAPES = {
    'tiny': dict(batch_size=8, seq_len=64, microbatches=1, steps=60, learning_rate=3e-3,
                 eval_tokens=2**13),
    'small': dict(batch_size=16, seq_len=128, microbatches=1, steps=500, learning_rate=2e-3),
    '100m': dict(batch_size=32, seq_len=512, microbatches=1, steps=2000, learning_rate=6e-4),
    '1b': dict(batch_size=64, seq_len=2048, microbatches=8, steps=10000, learning_rate=3e-4,
               precision='bf16_mixed', remat='full'),
    '7b': dict(batch_size=32, seq_len=4096, microbatches=4, steps=10000, learning_rate=3e-4,
               precision='bf16_mixed', remat='full'),
    '20b': dict(batch_size=64, seq_len=4096, microbatches=4, steps=10000, learning_rate=2e-4,
                precision='bf16_mixed', remat='full'),
    '70b': dict(batch_size=256, seq_len=4096, microbatches=4, steps=10000, learning_rate=1.5e-4,
                precision='bf16_mixed', remat='full'),
    '405b': dict(batch_size=512, seq_len=4096, microbatches=1, steps=10000, learning_rate=8e-5,
                 precision='bf16_mixed', remat='full'),
}


def model(name: str) -> dict:
  if name not in MODELS:
    raise ValueError(f'model preset {name!r} is not known; allowed: {", ".join(MODELS)}')
  # Llama's defaults (GPT-2's options: models/config.py).
  base = dict(rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True, remat='none',
              attention='auto', context_attention='gather', loss_chunk=0, scan_unroll=1,
              init_std=0.02,
              norm='rms', mlp='swiglu', positions='rope', bias=False, rope_scaling='none',
              rope_factor=1.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_len=8192)
  return {**base, **MODELS[name]}


def train_shape(name: str) -> dict:
  model(name)
  # A million validation tokens per evaluation: enough for a standard error of ~0.003 nats at the
  # small preset's loss (WORKSPACE, issue 16); tiny evaluates in a moment.
  return {'precision': 'fp32', 'remat': 'none', 'eval_tokens': 2**20, **TRAIN_SHAPES[name]}
