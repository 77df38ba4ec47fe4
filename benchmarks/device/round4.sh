#!/usr/bin/env bash
# The fourth GPU round (one H100): preflight against the real Trainer job on an H100 (issue 42 asks for that card),
# fit again with everything merged (its guide is now the whole-room replay answer, issue 35), and the GPU tests of
# the job's own counters (issue 41).
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/round4; mkdir -p $W
nvidia-smi -L
timeout 170 python3 benchmarks/preflight_vs_gpu.py $W/preflight > $W/preflight.log 2>&1; echo "preflight rc=$?"
timeout 260 python3 benchmarks/fit_vs_peers.py $W/fit-trainer --parts trainer > $W/fit.log 2>&1; echo "fit rc=$?"
timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_job_counters_gpu.py > $W/gputests.log 2>&1; echo "gpu tests rc=$?"
tail -3 $W/gputests.log
cd $W && tar cJf $OUT/round4.tar.xz preflight/preflight_vs_gpu.json preflight.log fit-trainer fit.log gputests.log
python3 -c "import json; d=json.load(open('preflight/preflight_vs_gpu.json')); print(d['gpu']['gpu_name'], d['gpu']['max_memory_allocated'], d['gpu']['max_memory_reserved'], d.get('ratios'))"
cat fit-trainer/summary.md
