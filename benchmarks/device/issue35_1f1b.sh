#!/usr/bin/env bash
# Issue 35: the points between of the 1F1B pipeline's sweep (docs/corpus/pipelining-1f1b-sweep.jsonl: 28 ran, 32 ran
# out on the last stage; diagnose answers 30, never run). The job exactly as scenarios/record_corpus.py swept it
# (JOBS["pipelining-1f1b"]: torchrun --standalone --nproc_per_node=2 scenarios/pipelining_1f1b.py --micro-batches 8
# --batch B, 2 steps, seq 2048), bare (record_corpus.py runs its points between unrecorded too), at 29, 30, 31, and 28
# and 32 again as controls: the boundary must reproduce on this machine before the points between count.
# Needs 2 GPUs of the corpus's kind (H200, 150,109,880,320 B each: the sweep's gpu_total_memory_bytes); on other GPUs
# it stops with exit 2 before any trial. Bare machine: torch 2.11, no network, no oomdoctor needed.
# Writes one JSON line per trial to $OUT/pipelining-1f1b-sweep-extra.jsonl: batch, exit_code, wall_s and each rank's
# ground truth (max_memory_reserved, max_memory_allocated, oom) as scenarios/_truth.py writes it. About 2.5 minutes.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/issue35-1f1b; rm -rf $W; mkdir -p $W $OUT
nvidia-smi -L
python3 - <<'PY' || exit 2
import torch, sys
n = torch.cuda.device_count()
tot = [torch.cuda.get_device_properties(i).total_memory for i in range(n)]
print("GPUs", n, tot)
if n < 2 or any(abs(t - 150_109_880_320) > 0.01 * 150_109_880_320 for t in tot[:2]):
    sys.exit("needs 2 GPUs of 150,109,880,320 B (H200), as the corpus's sweep ran on")
PY
trial() {  # batch
  local gt=$W/b$1.json t0=$(date +%s)
  (cd scenarios && timeout 240 python3 -m torch.distributed.run --standalone --nproc_per_node=2 pipelining_1f1b.py \
     --micro-batches 8 --batch $1 --ground-truth $gt) > $W/b$1.log 2>&1
  local rc=$? t1=$(date +%s)
  python3 - "$1" "$rc" "$((t1 - t0))" "$gt" >> $OUT/pipelining-1f1b-sweep-extra.jsonl <<'PY'
import json, sys
batch, rc, wall, gt = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
row = {"run": f"pipelining-1f1b-b{batch}", "batch": batch, "exit_code": rc, "wall_s": wall}
for rank, paths in ((0, [gt]), (1, [gt.replace(".json", ".rank1.json"), gt.replace(".json", ".rank{rank}.json")])):
    t = {}
    for path in paths:  # (.rank{rank}.json: the name a scenario before issue 35's fix wrote)
        try:
            t = json.load(open(path))
            break
        except Exception:  # a rank stopped by torchrun before it wrote its truth
            pass
    row[f"rank{rank}"] = {k: t.get(k) for k in ("max_memory_reserved", "max_memory_allocated", "oom",
                                                 "optimizer_steps", "gpu_total_memory_bytes", "torch")}
print(json.dumps(row))
PY
  echo "b$1 rc=$rc $((t1 - t0)) s"; tail -2 $W/b$1.log
}
for b in 28 32 29 30 31; do trial $b; done
cp $W/*.log $OUT/ 2>/dev/null
cat $OUT/pipelining-1f1b-sweep-extra.jsonl
