#!/usr/bin/env bash
# Round 14 (issue 50, item 4): the T5 Trainer job on one GPU, recorded with oomdoctor's recorder, and the same script
# traced by preflight on this machine's CPU (torch and transformers as installed here), then the two snapshots
# compared event by event (benchmarks/preflight_compare.py). Two sub-runs: bf16 and fp16 (GradScaler). About 3 minutes
# on one H200. Raw results: $OUT/round14_t5.tar.xz (snapshots, sidecars, JSON answers, comparisons, logs).
set -u
OUT=${1:-${OUT:?give an output directory}}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
W=/tmp/round14; rm -rf $W; mkdir -p $W
nvidia-smi -L > $W/gpu.txt 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" >> $W/gpu.txt 2>&1
JOB="tests/data/preflight_scripts/t5_trainer.py --batch 32 --src 512 --tgt 128 --d_model 512 --layers 6 --heads 8 --d_ff 2048 --steps 2"
for dt in bf16 fp16; do
  # the job on the GPU, recorded (every event, stacks; the snapshot dumped at the end)
  timeout 150 python3 -m oomdoctor run --out $W/gpu-$dt --stack-steps all -- \
      python3 $JOB --dtype $dt --output_dir $W/trainer-$dt > $W/gpu-$dt.log 2>&1; echo "gpu $dt rc=$?"
  # the job's own counters, for the peaks (the same script, no recorder)
  timeout 120 python3 - $dt > $W/peaks-$dt.json 2>$W/peaks-$dt.log <<'PY'
import json, runpy, sys, torch
dt = sys.argv[1]
sys.argv = ["t5_trainer.py"] + "--batch 32 --src 512 --tgt 128 --d_model 512 --layers 6 --heads 8 --d_ff 2048 --steps 2".split() + ["--dtype", dt, "--output_dir", "/tmp/round14/peaks-" + dt]
runpy.run_path("tests/data/preflight_scripts/t5_trainer.py", run_name="__main__")
print(json.dumps({"max_memory_allocated": torch.cuda.max_memory_allocated(), "max_memory_reserved": torch.cuda.max_memory_reserved()}))
PY
  echo "peaks $dt rc=$?"
  # the same script traced by preflight on the CPU
  CUDA_VISIBLE_DEVICES="" timeout 240 python3 -m oomdoctor preflight --gpu H200 --format json -o $W/traced-$dt.pickle -- \
      python3 $JOB --dtype $dt --output_dir $W/pf-$dt > $W/preflight-$dt.json 2> $W/preflight-$dt.log; echo "preflight $dt rc=$?"
  snap=$(ls $W/gpu-$dt/*.pickle 2>/dev/null | head -1)
  if [ -n "$snap" ] && [ -f $W/traced-$dt.pickle ]; then
    timeout 120 python3 benchmarks/preflight_compare.py "$snap" $W/traced-$dt.pickle --json $W/compare-$dt.json > $W/compare-$dt.txt 2>&1
    echo "compare $dt rc=$?"; head -12 $W/compare-$dt.txt
  fi
  python3 -c "import json; p=json.load(open('$W/preflight-$dt.json')); g=json.load(open('$W/peaks-$dt.json')); print('$dt', 'GPU', g, 'preflight', p['peak_allocated_bytes'], p['peak_reserved_bytes'], 'ratio', round(p['peak_allocated_bytes']/g['max_memory_allocated'], 4))" 2>&1 | tail -1
done
rm -rf $W/trainer-* $W/pf-* $W/peaks-bf16 $W/peaks-fp16
cd $W && tar cJf $OUT/round14_t5.tar.xz . 2>/dev/null; ls -la $OUT
