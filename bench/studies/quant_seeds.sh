#!/usr/bin/env bash
# The default run under each recipe of issue 4's table, two seeds, PARALLEL at a time (run on the
# lent H100 for WORKSPACE "Data at scale"). Writes OUT/quant_table.json (final evaluations).
#   OUT=results PARALLEL=10 bash bench/studies/quant_seeds.sh
set -u
OUT=${OUT:-bench/results/quant_seeds}; mkdir -p $OUT
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
python3 -m data.prepare --input='' --out=/tmp/prepared > $OUT/prepare.txt 2>&1
recipes=(
  "fp32|configs/default.py|"
  "bf16|configs/bf16.py|"
  "int8|configs/int8.py|"
  "int4|configs/int4.py|"
  "int4-lsq|configs/int4.py|--config.quant.learned_scale=True"
  "fp8|configs/fp8.py|"
  "fp8-delayed|configs/fp8.py|--config.quant.fp8_scaling=delayed"
  "llm_int8|configs/llm_int8.py|"
  "adam8bit|configs/adam8bit.py|"
  "bf16-adam8bit|configs/adam8bit.py|--config.precision=bf16"
)
jobs=()
for seed in 0 1; do
  for r in "${recipes[@]}"; do
    IFS='|' read -r name cfg extra <<< "$r"
    jobs+=("$name|$cfg|$extra|$seed")
  done
done
run_one() {
  IFS='|' read -r name cfg extra seed <<< "$1"
  python3 main.py --config=$cfg $extra --config.train.seed=$seed --config.data.path=/tmp/prepared \
    --workdir=/tmp/runs/q-$name-s$seed > /tmp/runs/log-$name-s$seed.txt 2>&1 || echo "FAILED $name $seed"
}
mkdir -p /tmp/runs
export -f run_one
printf '%s\n' "${jobs[@]}" | xargs -P ${PARALLEL:-5} -I{} bash -c 'run_one "{}"'
python3 - <<'PY' > $OUT/quant_table.json
import json, glob, os
rows = {}
for d in sorted(glob.glob('/tmp/runs/q-*')):
    m = [json.loads(l) for l in open(os.path.join(d, 'metrics.jsonl'))]
    ev = [r for r in m if 'eval_loss' in r]
    tps = [r['tokens_per_sec'] for r in m if 'tokens_per_sec' in r]
    rows[os.path.basename(d)] = {'final': ev[-1] if ev else None, 'tokens_per_sec_median': sorted(tps)[len(tps)//2] if tps else None}
print(json.dumps(rows, indent=1))
PY
tail -n 3 /tmp/runs/log-*.txt > $OUT/tails.txt
