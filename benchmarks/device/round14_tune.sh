#!/usr/bin/env bash
# Round 14, issue 51: `oomdoctor tune` against an exhaustive grid of short runs over the same space, on the same GPU
# (benchmarks/tune_vs_grid.py: tune first, its traces on the CPU and its top 2 run for real; then every configuration
# run with the same runner, 3 warm-up + 5 timed optimizer steps each). One part per device call:
#   one  (nvidia-h200, about 8 min)    GPT-2 medium under Hugging Face Trainer, sequence 1024, global batch 16:
#                                      micro-batch 4, 8, 16 x checkpointing none, full x AdamW fused, foreach (12);
#                                      then torchvision's ViT-B/16 script, global batch 256: micro-batch 32..256 x
#                                      checkpointing none, full (8)
#   two  (nvidia-h200-x2, about 5 min) a 0.95B Llama-shaped decoder under torchrun on 2 GPUs, sequence 2048, global
#                                      batch 32: micro-batch 8, 16 x DDP, FSDP2 full shard x checkpointing none,
#                                      full (8)
# DeepSpeed is not installed on these machines and is not built here: its ZeRO stages are not in the space (FSDP2's
# full shard and no-reshard modes stand for ZeRO-3 and ZeRO-2), and DeepSpeed's Autotuner is not run.
# Needs .mwhl/ (the package's dependencies as cp312 wheels; the machine has no network) carried with the tree.
#   bash benchmarks/device/round14_tune.sh OUT one|two
# Writes under OUT: machine-PART.txt, round14-tune-PART.tar.xz (each part's tune.json, tune.log, grid.json,
# summary.json and the runs' logs), summary-PART-*.json.
set -u
OUT=${1:?out dir}; PART=${2:?part: one or two}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
python3 -m pip install -q --no-index --no-deps --no-compile .mwhl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
{ nvidia-smi -L; nproc; uptime; python3 --version; python3 -c 'import torch, transformers, torchvision;
print("torch", torch.__version__, "transformers", transformers.__version__, "torchvision", torchvision.__version__)';
  python3 -c 'import deepspeed' 2>&1 | tail -1; git log --oneline -1 2>/dev/null; } > $OUT/machine-$PART.txt 2>&1
cat $OUT/machine-$PART.txt
W=/tmp/round14; mkdir -p $W
run() {  # run PART_NAME SECONDS ARGS...: one comparison, guarded; a failure is logged and the next one runs
  local name=$1 limit=$2; shift 2
  timeout $limit python3 benchmarks/tune_vs_grid.py $W --part $name "$@" > $W/$name.log 2>&1
  echo "$name rc=$?"; tail -45 $W/$name.log
  cp $W/$name/summary.json $OUT/summary-$PART-$name.json 2>/dev/null || true
}
case $PART in
  one) run gpt2 350 --top 2 --jobs 12 --tune-timeout 200
       run vit 140 --top 2 --jobs 12 --tune-timeout 90
       (cd $W && tar cJf $OUT/round14-tune-one.tar.xz gpt2 vit gpt2.log vit.log 2>/dev/null) ;;
  two) run llama 330 --top 2 --jobs 16 --tune-timeout 170
       (cd $W && tar cJf $OUT/round14-tune-two.tar.xz llama llama.log 2>/dev/null) ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
uptime
