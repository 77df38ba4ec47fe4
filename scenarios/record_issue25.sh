#!/usr/bin/env bash
# The corpus runs added for issues 25/26 (docs/corpus/README.md): new kinds of job, recorded on a machine with
# 2 GPUs as users record them (oomdoctor run's defaults; plain _record_memory_history for two). Single-GPU jobs
# run in two queues, one per GPU, then the 2-GPU jobs. Everything is packed into $OUT as rec.tar.xz.part-*.
#   B1=300 B2=220 bash scenarios/record_issue25.sh          # budgets in seconds for the two phases
#   Q0=... Q1=... A=... RESUME=1 bash ...   # other plans (runs, sweeps, reruns <run>@<allocator setting>); sweeps
#                                           # go on from the rows docs/corpus holds
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/rec-out}; mkdir -p "$OUT"
W=/tmp/rec; rm -rf "$W"; mkdir -p "$W"
[ -d .whl ] && python3 -m pip install -q --no-deps --no-index .whl/*.whl > "$W/pip.log" 2>&1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, deepspeed, transformers, oomdoctor; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'transformers', transformers.__version__)"; } > "$W/gpu.txt" 2>&1
Q0=${Q0-own-optimizer-adam,plain-record-gpt2,deepspeed-z1-gpt2,generate-mha,eval-no-grad-decoder,deepspeed-z3-gpt2-b16,empty-cache-loop}
Q1=${Q1-own-optimizer-lion,plain-record-resnet50,deepspeed-z2-gpt2,generate-gqa,pipeline-gpipe,eval-no-grad-gpt2,trainer-gpt2-eval-accumulation-steps}
A=${A-wrapped-trainer-ddp-gpt2-b32,first-forward-trainer-ddp-gpt2-b160,pipelining-1f1b,wrapped-accelerate-ddp-llama-b16,first-forward-accelerate-ddp-llama-b128}
if [ -n "$Q0$Q1" ]; then
  CUDA_VISIBLE_DEVICES=0 python3 scenarios/record_corpus.py --out "$W/q0" --plan "$Q0" --budget-s "${B1:-300}" --max-sweep-runs 4 ${RESUME:+--resume} > "$W/q0.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 python3 scenarios/record_corpus.py --out "$W/q1" --plan "$Q1" --budget-s "${B1:-300}" --max-sweep-runs 4 ${RESUME:+--resume} > "$W/q1.log" 2>&1 &
  wait
fi
[ -n "$A" ] && python3 scenarios/record_corpus.py --out "$W/a" --plan "$A" --budget-s "${B2:-220}" --max-sweep-runs 4 ${RESUME:+--resume} > "$W/a.log" 2>&1
tar -C "$W" -cf - . | xz -T0 -6 | split -b 15m - "$OUT/rec.tar.xz.part-"
cat "$W/gpu.txt"; grep -h -E "exit|largest|skipped|failed" "$W"/*.log
ls -la "$OUT"
