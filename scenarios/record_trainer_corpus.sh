#!/bin/bash
# On 2 GPUs: the Hugging Face Trainer DDP GPT-2 job (scenarios/trainer_gpt2.py, 124M, seq 1024, bf16) as a
# corpus run with its own ground truth. A batch sweep (plain torchrun, per-device micro-batch B) finds the
# largest batch that fits; then the largest fitting batch and the first that does not are recorded under
# `oomdoctor run`. Results in $OUT: sweep.jsonl (one ground-truth record per batch), and per recorded run
# a .tar.xz of the snapshot directory with its ground truth and the job's log.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/corpus}; mkdir -p "$OUT"; W=$(mktemp -d)
STEPS=${STEPS:-4}; BATCHES=${BATCHES:-"48 56 64 72 80"}
job() {  # job NAME B [oomdoctor run options ...]
  local name=$1 b=$2; shift 2
  python3 -m torch.distributed.run --standalone --nproc_per_node=2 scenarios/trainer_gpt2.py --steps "$STEPS" \
    --batch "$b" --output-dir "$W/hf" --ground-truth "$W/$name.truth.json" > "$W/$name.log" 2>&1
}
fits=""; oom=""
for b in $BATCHES; do
  job "sweep-b$b" "$b"; rc=$?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['exit_code']=int(sys.argv[2]); print(json.dumps(d))" \
    "$W/sweep-b$b.truth.json" "$rc" >> "$OUT/sweep.jsonl" 2>/dev/null || echo "{\"batch\": $b, \"exit_code\": $rc}" >> "$OUT/sweep.jsonl"
  echo "batch $b: exit $rc"
  if [ "$rc" = 0 ]; then fits=$b; elif [ -z "$oom" ]; then oom=$b; fi
done
for pair in "fits:$fits" "oom:$oom"; do
  kind=${pair%%:*}; b=${pair#*:}; [ -n "$b" ] || continue
  name="trainer-ddp-gpt2-b$b"; dir="$W/$name"; mkdir -p "$dir"
  python3 -m oomdoctor run --out "$dir" --no-diagnose -- python3 -m torch.distributed.run --standalone \
    --nproc_per_node=2 scenarios/trainer_gpt2.py --steps "$STEPS" --batch "$b" --output-dir "$W/hf" \
    --ground-truth "$dir/ground_truth.json" > "$dir/job.log" 2>&1
  echo "recorded $name ($kind): exit $? files: $(ls "$dir" | tr '\n' ' ')"
  tar -C "$W" -cJf "$OUT/$name.tar.xz" "$name"
done
ls -la "$OUT"
