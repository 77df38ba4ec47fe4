#!/usr/bin/env bash
# The seventh GPU round (1 GPU): the points between of round 6's new-kinds sweep, where the replayed answers fell
# (diagnose on the corpus's b8 runs with the GPU's total memory given: gpu-dataset 183, teacher 130,
# chunked-loss 345, ema 183, compiled-step 183), each trial as sweep_new_kinds.py runs it
# (new_kinds.py --size small --seq 1024 --steps 3 --record none, a fresh process).
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/round7; mkdir -p $W
nvidia-smi -L
trial() {  # kind batch
  local gt=$W/$1-b$2.json
  timeout 150 python3 scenarios/new_kinds.py --kind $1 --size small --batch $2 --seq 1024 --steps 3 --record none \
    --ground-truth $gt > $W/$1-b$2.log 2>&1
  local rc=$?
  python3 - "$1" "$2" "$rc" "$gt" >> $OUT/new-kinds-sweep-extra.jsonl <<'PY'
import json, sys
kind, batch, rc, gt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
try:
    t = json.load(open(gt))
except Exception:
    t = {}
t.update(run=f"new-kinds-sweep-{kind}-b{batch}", kind=kind, batch=batch, exit_code=rc)
print(json.dumps(t))
PY
  echo "$1 b$2 rc=$rc"
}
for b in 183 186 188; do trial gpu-dataset $b; done
for b in 129 130 131 132; do trial teacher $b; done
for b in 356 362; do trial chunked-loss $b; done
for b in 183 188; do trial ema $b; done
for b in 176 183 190; do trial compiled-step $b; done
