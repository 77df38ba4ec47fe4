#!/usr/bin/env bash
# The fifth GPU round (4 GPUs, issue 38 item 3): recording overhead of today's default against `--stack-steps 3/10`
# with more repetitions than round 3 (7 instead of 3, 80 steps a run instead of 40),
# on the Trainer DDP job (2 GPUs) and the plain loop (1 GPU), two lanes at once.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/round5; mkdir -p $W
nvidia-smi -L
timeout 560 python3 benchmarks/bench_recording_modes.py --out $W/rec --lanes "0,1;2,3" --reps 7 --steps 80 \
  --trainer-modes plain,default,new --loop-modes plain,default,new --budget-s 500 \
  --job-timeout-s 120 > $W/bench.log 2>&1; echo "bench rc=$?"
tail -40 $W/bench.log
cd $W && tar cJf $OUT/round5.tar.xz rec bench.log
