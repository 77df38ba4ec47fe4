#!/usr/bin/env bash
# Prepared for issue 39, NOT RUN: the 4-GPU kinds were withdrawn before it could run (status listed 2 GPUs at most). What issue 39 asks, on the largest kind lent (4 GPUs, not 8): a 2-D job (FSDP2 x TP,
# scenarios/new_kinds.py --kind fsdp2-tp, large) run twice under `oomdoctor run --summarize` at default settings:
# healthy, and with one data-parallel replica (rank 2) keeping every step's logits. Each rank measures itself
# (truth_rank{R}.json). The offline diagnoses (default executor here; dask on the CPU machine) come back with the
# snapshots.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/round6; mkdir -p $W
nvidia-smi -L
for mode in healthy faulty; do
  extra=""; [ $mode = faulty ] && extra="--keep-logits-rank 2"
  mkdir -p $W/$mode-truth
  timeout 240 python3 -m oomdoctor run --summarize --out $W/$mode -- torchrun --standalone --nproc_per_node=4 \
    scenarios/new_kinds.py --kind fsdp2-tp --size large --record none --steps 8 \
    --ground-truth "$W/$mode-truth/truth_rank{rank}.json" $extra > $W/$mode.run.log 2>&1
  echo "$mode run rc=$?"
  tail -5 $W/$mode.run.log
  python3 -m oomdoctor diagnose $W/$mode > $W/$mode.diagnose.txt 2>&1; echo "$mode diagnose rc=$?"
  python3 -m oomdoctor diagnose --format json -o $W/$mode.diagnose.json $W/$mode 2>/dev/null
  head -30 $W/$mode.diagnose.txt
done
ls -la $W/healthy $W/faulty
cd $W && tar cJf $OUT/round6.tar.xz healthy faulty healthy-truth faulty-truth *.log *.diagnose.*
