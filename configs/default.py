"""Train a byte-level Llama-style model on the embedded corpus (the Python standard library's source).

  python main.py                                         # this config, preset `small`, ~3 minutes on 2 cores
  python main.py --config=configs/default.py:tiny        # a seconds-long smoke run
  python main.py --config=configs/default.py:1b --dry_run
  python main.py --config.train.steps=60 --workdir=runs/try   # any key can be overridden
"""
import os

import ml_collections

from configs import presets

# JAX's persistent compilation cache, per user (JAX's own JAX_COMPILATION_CACHE_DIR, when set, wins).
COMPILE_CACHE = (os.environ.get('JAX_COMPILATION_CACHE_DIR') or os.path.join(
    os.environ.get('XDG_CACHE_HOME') or '~/.cache', 'less-memory-lm', 'jax'))


def get_config(preset: str | None = None) -> ml_collections.ConfigDict:
  preset = preset or 'small'
  shape = presets.train_shape(preset)
  config = ml_collections.ConfigDict()
  config.name = f'default:{preset}'
  config.description = 'one device (or data parallel over all of them)'
  config.model = presets.model(preset)
  config.model.remat = shape['remat']     # none | full | dots | qkv | offload | dots_offload
  config.precision = shape['precision']   # fp32 | bf16_mixed | bf16_master | bf16 | fp16

  config.train = dict(
      steps=shape['steps'],
      batch_size=shape['batch_size'],     # global, in sequences
      seq_len=shape['seq_len'],
      learning_rate=shape['learning_rate'],
      warmup_steps=0,                     # set below, from steps
      min_lr_ratio=0.1,                   # cosine decays to this fraction of the peak
      weight_decay=0.1,
      b1=0.9,
      b2=0.95,
      grad_clip=1.0,                      # global-norm clipping
      microbatches=shape['microbatches'], # gradient accumulation
      log_every=10,
      eval_every=0,                       # set below, from steps
      eval_tokens=shape['eval_tokens'],   # validation tokens per evaluation (whole batches)
      checkpoint_every=0,                 # set below, from steps
      checkpoint_minutes=0.0,             # > 0: also save when this many minutes passed since the last
      keep_checkpoints=3,
      max_bad_steps=5,                    # stop after this many non-finite steps in a row (each skipped)
      seed=0,
  )
  # References, so that --config.train.steps=N moves them too (unless they are set themselves):
  # warmup 5 % of the run, 2 evaluations after the untrained one's (each reads eval_tokens: a
  # million for the small preset, about 40 s on 2 CPU cores) and 2 checkpoints (rounded up, so
  # never 0).
  steps = config.train.get_ref('steps')
  config.train.warmup_steps = (steps + 19) // 20
  config.train.eval_every = (steps + 1) // 2
  config.train.checkpoint_every = (steps + 1) // 2
  config.data = dict(
      path='',                            # a glob of text files ('' = the embedded stdlib corpus),
                                          # prepared into WORKDIR/data on first use; or a directory
                                          # made by python -m data.prepare
      val_fraction=0.05,                  # of the documents, by path hash (a glob; a prepared
                                          # directory has its own split)
      verify_inputs='sampled',            # a start checks inputs and shards by size and a sampled
                                          # fingerprint (<= 512 KiB a file); 'full': every byte
      packing=True,                       # several documents per row, kept apart by segment ids;
                                          # False: one document per row, padded
      tokenizer='bytes',                  # 'bytes', or a tokenizer.json / Hugging Face checkpoint
                                          # directory (python -m data.tokenizer trains one; an
                                          # imported model's own); the model's vocabulary follows it
      text_field='text',                  # a glob's .jsonl(.gz/.zst) / .parquet: the text's field
                                          # (a dotted path reaches into objects: meta.body)
      document_delimiter='',              # a glob's text files: cut into documents where it
                                          # occurs ('\\n\\n': a blank line); '' = one per file
      on_bad_record='fail',               # a glob's bad records: fail (naming file and line) or
                                          # skip (counted in the prepared index)
  )
  config.mesh = dict(stage=1, data=-1, fsdp=1, context=1, tensor=1)  # axis -> size; one -1: the rest
  config.parallel = dict(
      zero_stage=0,                       # 0 DDP, 1-3 ZeRO stages over fsdp x context
      pipeline_schedule='gpipe',          # with mesh.stage > 1: gpipe, circular (interleaved),
                                          # 1f1b, interleaved_1f1b or zb_h1 (zero bubble)
                                          # (docs/parallel.md: which to use)
      pipeline_microbatches=4,            # per step (per train.microbatches), at least mesh.stage
      pipeline_repeats=1,                 # circular, interleaved_1f1b: layer chunks per stage
      pipeline_stage_layers='',           # layers per chunk in model order ('7,8,8,7'); '':
                                          # chunks of ceil(layers / chunks), the last ones less
                                          # (any layer count on any stage count; with
                                          # mesh.stage=1, as the other pipeline_* keys, unused)
      pipeline_gather_once=False,         # gpipe, circular under ZeRO-3: each stage's weights
                                          # gathered once per step, not at every iteration (the
                                          # 1f1b schedules always do); holds them whole
      offload_optimizer=False,            # fp32 master and Adam moments in host memory, streamed
                                          # to the device a layer at a time for the update
      offload_update='device',            # with offload_optimizer: 'device' (streamed, as above)
                                          # or 'host' (the update computed by the host's
                                          # processor where the state lives; only the weights
                                          # and gradients cross, in their stored dtype)
      offload_frozen=False,               # LoRA/QLoRA: the frozen base in host memory, streamed
                                          # to the device a layer at a time
  )
  config.host_devices = 0                 # >0: with no accelerator, simulate this many CPU devices
  config.compile_cache = COMPILE_CACHE    # compiled programs kept here for reruns and resumes; '' = off
  config.quant = dict(
      mode='none',                        # matmuls: none, int8, int4, fp8, llm_int8 (quant/recipe.py)
      block_size=0,                       # 0: a scale per channel/token; n: per n inputs (int8/int4/fp8)
      int8_backward=False,                # int8: quantize the gradients of the matmuls too
      learned_scale=False,                # int4: learn the step sizes (LSQ) instead of absmax
      threshold=6.0,                      # llm_int8: |activation| above which a column is an outlier
      fp8_scaling='current',              # fp8: 'current' (this tensor's absmax) or 'delayed' (history)
      amax_history=16,                    # fp8 delayed: steps of absmax history
      adam_bits=32,                       # 32, or 8: Adam's moments block-wise quantized to 8 bits
      adam_block_size=2048,               # values per quantization block (256 or 2048)
      weights='none',                     # LoRA only: the frozen base's dense kernels stored in
                                          # none (floats), int8, int4 or nf4 (QLoRA)
  )
  # Where a fresh run's weights come from: '' random; 'hf:DIR' a local Hugging Face Llama or GPT-2
  # checkpoint (safetensors + config.json; the model shape is read from it); 'run:DIR' the latest
  # checkpoint of an earlier run of ours. A workdir with checkpoints resumes from them instead.
  config.init_from = ''
  config.lora = dict(
      rank=0,                             # 0: every weight trains; r > 0: only rank-r adapters
      alpha=16.0,                         # the update is scaled by alpha / rank
      dropout=0.0,                        # on the adapters' input, while training
      targets='.*attention/(query|value)',  # regex over dense-layer paths (the LoRA paper: W_q, W_v)
  )
  config.sample = dict(prompt='def ', length=200, temperature=0.8)
  return config


def override(config: ml_collections.ConfigDict, key: str, value) -> None:
  """Sets a dotted key (`train.steps`) the way `--config.train.steps=...` does."""
  *parents, leaf = key.split('.')
  node = config
  for part in parents:
    node = node[part]
  node[leaf] = value


def variant(name: str, preset: str | None, overrides: dict,
            description: str) -> ml_collections.ConfigDict:
  """The default experiment on `preset` with dotted-key `overrides`: what every named layout,
  precision and fine-tuning recipe is."""
  config = get_config(preset)
  config.name = f'{name}:{preset or "small"}'
  config.description = description
  for key, value in overrides.items():
    override(config, key, value)
  return config
