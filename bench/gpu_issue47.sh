#!/usr/bin/env bash
# Issue 47's measurements on one GPU in one call of at most 8 minutes, most wanted first; a
# part that would start with under 30 s left is skipped and says so. Results (logs, JSON, and
# summary.md) go to $OUT (the device tool's folder), or runs/issue47-gpu; at the end the parts'
# files are packed into $OUT/parts.tgz, since the device tool brings back only a few files.
#
#   bash bench/gpu_issue47.sh [BUDGET_S]     # default 420 s of measuring
#   bash bench/gpu_issue47.sh 60 --smoke     # the plumbing on a CPU: tiny shapes, 2 steps
#
# 1. versus: ours (1b, bf16_mixed, remat none, the layer scan unrolled) against the same model's
#    PyTorch loop under torch.compile (bf16 autocast over fp32 weights, fused AdamW), one program
#    at a time.
# 2. bf16_master with the optimizer in host memory against without, its update computed on the
#    host (parallel.offload_update=host) and streamed, and the offloaded step's profile (its host
#    transfers: the layer stacks no longer copied within host memory, train/donation.py).
# 3. profile: where our 1b step's time goes on the GPU, kernel by kernel (command buffers off).
# 4. bf16 with remat dots, rolled and unrolled; fp8 with current and with delayed scaling
#    against it (the GPU suite's shape).
# On a lent machine (Python 3.12, jax 0.11) the packages its image lacks travel as wheels in
# .whl/ (WORKSPACE.md, "The GPU suite"): the device call carries `.whl`.
set -u
BUDGET=${1:-420}
SMOKE=${2:-}
OUT=${OUT:-runs/issue47-gpu}
mkdir -p "$OUT"
START=$SECONDS
if ! python3 -c 'import ml_collections, grain, qwix, tensorboardX, portpicker' 2> /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONUNBUFFERED=1 TF_CPP_MIN_LOG_LEVEL=3
# One program holds the device at a time: let JAX's allocator have 95 % of it (its default 75 %
# of an H100 is 60 GB, and the 1b step with remat none compiles to 56.5 GiB). jaxlib refuses the
# two names at once: set the one not already set.
if [ -z "${XLA_CLIENT_MEM_FRACTION:-}" ]; then
  export XLA_PYTHON_CLIENT_MEM_FRACTION=${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.95}
fi

# UNROLL: the shape's layers (PRESET_LAYERS: the preset's), the layer scan unrolled (258.0 ->
# 239.4 ms a step on an H200 at 1b, bench/results/issue47-nvidia-h200-3/).
if [ "$SMOKE" = --smoke ]; then
  PRESET=configs/default.py:tiny; SHAPE=small; ROWS=8; LENGTH=64; STEPS=2; WARMUP=1; UNROLL=4
  PRESET_LAYERS=2
else
  PRESET=configs/default.py:1b; SHAPE=1b; ROWS=8; LENGTH=2048; STEPS=10; WARMUP=3; UNROLL=16
  PRESET_LAYERS=16
fi
ONE="--config.mesh.data=1 --config.mesh.fsdp=1 --config.mesh.tensor=1 \
--config.parallel.zero_stage=0 --config.train.microbatches=1 --config.data.packing=False \
--config.train.batch_size=$ROWS --config.train.seq_len=$LENGTH"

# part NAME LIMIT_S COMMAND...: runs COMMAND with its output in $OUT/NAME.log, for at most LIMIT_S
# or what is left of the budget.
part() {
  local name=$1 limit=$2 left
  shift 2
  left=$((BUDGET - (SECONDS - START)))
  if [ "$left" -lt 30 ]; then
    echo "=== $name: not run, $left s of the budget left" | tee "$OUT/$name.log"
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (at most $limit s): $*"
  local begin=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "exit $? after $((SECONDS - begin)) s"
  tail -n 12 "$OUT/$name.log"
}

step() {   # step NAME LIMIT_S OVERRIDES...: bench.train_step of the preset at the issue's shape
  local name=$1 limit=$2
  shift 2
  part "$name" "$limit" python3 -m bench.train_step --config=$PRESET $ONE "$@" \
    --steps=$STEPS --warmup=$WARMUP --out="$OUT/$name.json"
}

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/device.txt" 2>&1
python3 -c 'import jax, sys; print(sys.version.split()[0], "jax", jax.__version__, jax.devices())' \
  >> "$OUT/device.txt" 2>&1
python3 -c 'import torch; print("torch", torch.__version__)' >> "$OUT/device.txt" 2>&1
cat "$OUT/device.txt"

part versus 200 python3 -m bench.versus --shape=$SHAPE --precision=bf16_mixed \
  --programs=torch_compile,ours_step --ours=model.remat=none --ours=model.scan_unroll=$UNROLL \
  --steps=$STEPS --warmup=$WARMUP --rounds=2 --out="$OUT/versus.json"
step master_dots 60 --config.precision=bf16_master --config.model.remat=dots
# Item 5: the offloaded update computed on the host (only bf16 weights and gradients cross).
step master_offload_host_dots 90 --config.precision=bf16_master --config.model.remat=dots \
  --config.parallel.offload_optimizer=True --config.parallel.offload_update=host
step master_offload_dots 90 --config.precision=bf16_master --config.model.remat=dots \
  --config.parallel.offload_optimizer=True
# Its optimized program comes back too (hlo_offload): the deviceless compile of this step placed
# the offloaded state wrongly until this stop (WORKSPACE, "Host placements on compile-only GPUs").
part profile_offload 80 env XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo_offload \
--xla_dump_hlo_as_text --xla_dump_hlo_module_re=train_step" python3 -m bench.profile \
  --config=$PRESET $ONE --config.precision=bf16_master --config.model.remat=dots \
  --config.parallel.offload_optimizer=True --config.compile_cache= --steps=2 --warmup=2 \
  --noloop --out="$OUT/profile_offload.json"
# The profile's step also leaves XLA's optimized program (the GPU's own, autotuned: what a compile
# without the device cannot show, such as which products XLA merged) in $OUT/hlo; compiled anew
# (the compile cache's key leaves the dump flags out, and a program it loads is not dumped).
part profile 80 env XLA_FLAGS="${XLA_FLAGS:-} --xla_dump_to=$OUT/hlo --xla_dump_hlo_as_text \
--xla_dump_hlo_module_re=train_step" python3 -m bench.profile --config=$PRESET $ONE --config.precision=bf16_mixed \
  --config.model.remat=none --config.compile_cache= --steps=2 --warmup=2 --noloop \
  --out="$OUT/profile.json"
step bf16_dots 60 --config.precision=bf16_mixed --config.model.remat=dots
# The layer scan unrolled under remat dots: its recomputation no longer merged into the forward
# (models/llama.py, 2026-12-07; 37.70 GiB compiled for an H200, the rolled step's), so it may be
# the fastest step that saves activations.
step bf16_dots_unrolled 70 --config.precision=bf16_mixed --config.model.remat=dots \
  --config.model.scan_unroll=$PRESET_LAYERS
step fp8_dots 160 --config.precision=bf16_mixed --config.model.remat=dots --config.quant.mode=fp8
step fp8_delayed_dots 90 --config.precision=bf16_mixed --config.model.remat=dots \
  --config.quant.mode=fp8 --config.quant.fp8_scaling=delayed

python3 - "$OUT" << 'EOF' | tee "$OUT/summary.md"
"""The issue's goals from what the parts wrote (a part not run leaves its row empty)."""
import json, os, sys
out = sys.argv[1]
def read(name):
  path = os.path.join(out, name + '.json')
  return json.load(open(path)) if os.path.exists(path) else None
rate = lambda name: (read(name) or {}).get('tokens_per_sec')
versus = read('versus') or {}
best = versus.get('best_tokens_per_sec', {})
def ratio(a, b):
  return f'{a / b:.3f}' if a and b else 'not measured'
def pair(a, b):
  return ' against '.join(f'{x:,.0f}' if x else '-' for x in (a, b)) + ' tokens/s'
rows = [('ours >= 1.0x torch.compile (1b, bf16_mixed)', best.get('ours_step'), best.get('torch_compile')),
        ('remat dots, the layer scan unrolled against rolled', rate('bf16_dots_unrolled'),
         rate('bf16_dots')),
        ('fp8 delayed >= 0.95x fp8 current', rate('fp8_delayed_dots'), rate('fp8_dots')),
        ('fp8 >= 1.15x bf16', rate('fp8_dots'), rate('bf16_dots')),
        ('offloaded step <= 1.5x the step without (ratio: its step / the step without)',
         rate('master_dots'), rate('master_offload_dots')),
        ('the same, its update on the host (parallel.offload_update=host)',
         rate('master_dots'), rate('master_offload_host_dots'))]
print('| goal | measured | ratio |\n|---|---|---:|')
for goal, a, b in rows:
  print(f'| {goal} | {pair(a, b)} | {ratio(a, b)} |')
EOF
# The device tool brings back a handful of files: the summary, the device and one archive.
find "$OUT/hlo" "$OUT/hlo_offload" -type f ! -name '*after_optimizations.txt' \
  ! -name '*thunk_sequence.txt' -delete 2> /dev/null
find "$OUT/hlo" "$OUT/hlo_offload" -type d -empty -delete 2> /dev/null
(cd "$OUT" && shopt -s nullglob && tar czf parts.tgz --remove-files ./*.json ./*.log \
  $(ls -d hlo hlo_offload 2> /dev/null))
echo "done in $((SECONDS - START)) s"
