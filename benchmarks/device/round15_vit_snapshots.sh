#!/usr/bin/env bash
# Issue 51's ViT script (benchmarks/tune_jobs/vit_train.py): why preflight's peak reserved is 170-260 MiB below the
# H200's (round 14, docs/tune.md "The ViT script's peaks"). At micro-batch 1 (round 14's fit-vit snapshot) the trace
# matches the GPU to the byte; at 32 and above it does not, and what differs is not in that snapshot. This records
# the GPU's snapshot of three of the grid's configurations (every event, stacks), the job's own peaks without the
# recorder, preflight's trace of the same configuration on this machine's CPU, and the two snapshots compared event
# by event (benchmarks/preflight_compare.py). About 3 minutes on one H200; each sub-run guarded by `timeout`.
#   bash benchmarks/device/round15_vit_snapshots.sh OUT
# Writes OUT/round15_vit_snapshots.tar.xz (snapshots, sidecars, peaks, preflight answers, comparisons, logs).
set -u
OUT=${1:-${OUT:?give an output directory}}
export PYTHONUNBUFFERED=1
W=/tmp/round15_vit; rm -rf $W; mkdir -p $W
{ nvidia-smi -L; python3 -c "import torch, torchvision; print('torch', torch.__version__, 'cudnn',
  torch.backends.cudnn.version(), 'torchvision', torchvision.__version__)"; } > $W/machine.txt 2>&1
JOB=benchmarks/tune_jobs/vit_train.py
for cfg in "32 2 full" "32 2 none" "128 2 none"; do
  set -- $cfg; name=mb$1-ga$2-$3; args="--bs $1 --ga $2 --ac $3 --steps 2"
  timeout 120 python3 -m oomdoctor run --out $W/gpu-$name --stack-steps all -- python3 $JOB $args \
      > $W/gpu-$name.log 2>&1; echo "$name gpu rc=$?"
  timeout 90 python3 - $args > $W/peaks-$name.json 2> $W/peaks-$name.log <<'PY'
import json, runpy, sys, torch
sys.argv = ["vit_train.py"] + sys.argv[1:]
runpy.run_path("benchmarks/tune_jobs/vit_train.py", run_name="__main__")
print(json.dumps({"max_memory_allocated": torch.cuda.max_memory_allocated(),
                  "max_memory_reserved": torch.cuda.max_memory_reserved()}))
PY
  echo "$name peaks rc=$?"
  CUDA_VISIBLE_DEVICES="" timeout 150 python3 -m oomdoctor preflight --gpu H200 --format json \
      -o $W/traced-$name.pickle -- python3 $JOB $args > $W/preflight-$name.json 2> $W/preflight-$name.log
  echo "$name preflight rc=$?"
  snap=$(ls $W/gpu-$name/*.pickle 2>/dev/null | head -1)
  if [ -n "$snap" ] && [ -f $W/traced-$name.pickle ]; then
    timeout 120 python3 benchmarks/preflight_compare.py "$snap" $W/traced-$name.pickle --json $W/compare-$name.json \
        > $W/compare-$name.txt 2>&1; echo "$name compare rc=$?"; head -12 $W/compare-$name.txt
  fi
done
cd $W && tar cJf $OUT/round15_vit_snapshots.tar.xz . 2>/dev/null; ls -la $OUT
