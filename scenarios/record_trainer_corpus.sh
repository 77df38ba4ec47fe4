#!/bin/bash
# On 2 GPUs: the Hugging Face Trainer DDP GPT-2 job (scenarios/trainer_gpt2.py, 124M, seq 1024, bf16) as a
# corpus run with its own ground truth. A batch sweep (plain torchrun, per-device micro-batch B) finds the
# largest batch that fits; then the largest fitting batch and the first that does not are recorded under
# `oomdoctor run`. Results in $OUT: sweep.jsonl (one ground-truth record per batch), and per recorded run
# a .tar.xz of the snapshot directory with its ground truth and the job's log.
# With MODE=more it records instead: Trainer.evaluate() with compute_metrics gathering every batch's logits
# on the GPU, the same with eval_accumulation_steps=4, and batch 88 with gradient checkpointing.
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
record() {  # record NAME TRAINER-ARGS...: under oomdoctor run, archived into $OUT/NAME.tar.xz
  local name=$1; shift; local dir="$W/$name"; mkdir -p "$dir"
  python3 -m oomdoctor run --out "$dir" --no-diagnose -- python3 -m torch.distributed.run --standalone \
    --nproc_per_node=2 scenarios/trainer_gpt2.py --steps "$STEPS" --output-dir "$W/hf" \
    --ground-truth "$dir/ground_truth.json" "$@" > "$dir/job.log" 2>&1
  echo "recorded $name: exit $? files: $(ls "$dir" | tr '\n' ' ')"
  tar -C "$W" -cJf "$OUT/$name.tar.xz" "$name"
}
if [ "${MODE:-sweep}" = more ]; then
  record trainer-ddp-gpt2-eval-accumulate --batch 16 --eval-samples 384 --eval-batch 16
  record trainer-ddp-gpt2-eval-accumulation-steps --batch 16 --eval-samples 384 --eval-batch 16 \
    --eval-accumulation-steps 4
  record trainer-ddp-gpt2-checkpointing-b88 --batch 88 --gradient-checkpointing
  ls -la "$OUT"; exit 0
fi
fits=""; oom=""
for b in $BATCHES; do
  job "sweep-b$b" "$b"; rc=$?
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); d['exit_code']=int(sys.argv[2]); print(json.dumps(d))" \
    "$W/sweep-b$b.truth.json" "$rc" >> "$OUT/sweep.jsonl" 2>/dev/null || echo "{\"batch\": $b, \"exit_code\": $rc}" >> "$OUT/sweep.jsonl"
  echo "batch $b: exit $rc"
  if [ "$rc" = 0 ]; then fits=$b; elif [ -z "$oom" ]; then oom=$b; fi
done
for b in $fits $oom; do
  record "trainer-ddp-gpt2-b$b" --batch "$b"
done
ls -la "$OUT"
