#!/usr/bin/env bash
# Held-out runs for the planner's hf terms (docs/plan.md, "Held-out runs"): loops, shapes and settings the terms
# were not read from. Each job measures itself (scenarios/_truth.py); run on 2 GPUs, plain torchrun, no oomdoctor.
#   bash scenarios/plan_holdout.sh OUTDIR
set -u
out=${1:?OUTDIR}
mkdir -p "$out"
cd "$(dirname "$0")"
run() {  # name batch command...
    local name=$1 batch=$2; shift 2
    timeout 300 "$@" --ground-truth "$out/$name-b$batch.json" > "$out/$name-b$batch.log" 2>&1
    local rc=$?
    python3 - "$out/$name-b$batch.json" "$name" "$batch" "$rc" >> "$out/$name-sweep.jsonl" <<'PY'
import json, sys
path, name, batch, rc = sys.argv[1:]
try:
    d = json.load(open(path))
except OSError:
    d = {}
d.update(run=f"{name}-b{batch}", batch=int(batch), exit_code=int(rc))
print(json.dumps(d))
PY
    echo "$name b$batch rc=$rc $(grep -o '"max_memory_allocated": [0-9]*' "$out/$name-b$batch.json" 2>/dev/null)"
}
TR="python3 -m torch.distributed.run --standalone --nproc_per_node=2"
# Lightning DDP: autocast over fp32 weights, the KV cache on, no fp32 copy or DDP clone of the logits
run holdout-lightning-ddp-gpt2 24 python3 lightning_gpt2.py --devices 2 --strategy ddp --batch 24 --steps 3
# Trainer DDP, another GPT-2 shape (6 x 1024, 16 heads) and sequence 512
run holdout-trainer-ddp-gpt2-6x1024 32 $TR trainer_gpt2.py --batch 32 --steps 3 --seq 512 --layers 6 --width 1024 --output-dir /tmp/ho1
# Trainer FSDP2 at sequence 512
run holdout-trainer-fsdp2-gpt2 40 $TR trainer_gpt2.py --fsdp --batch 40 --steps 3 --seq 512 --output-dir /tmp/ho2
# Trainer DDP with gradient checkpointing at another batch
run holdout-trainer-ddp-gpt2-checkpointing 48 $TR trainer_gpt2.py --gradient-checkpointing --batch 48 --steps 3 --output-dir /tmp/ho3
# accelerate Llama: another shape (4 x 2048, 32 heads), no gradient accumulation, sequence 1024
run holdout-accelerate-ddp-llama-4x2048 12 $TR accelerate_llama.py --batch 12 --steps 3 --grad-accum 1 --layers 4 --width 2048 --seq 1024
# accelerate Llama with 4 accumulation steps
run holdout-accelerate-ddp-llama-ga4 24 $TR accelerate_llama.py --batch 24 --steps 2 --grad-accum 4
