#!/usr/bin/env bash
# Round 15 (issue 50): memory snapshots of the corpus's one-GPU scripts at their K-th optimizer step, for
# preflight_compare.py; HALF=dev (default), heldout or all (see round15_dev_snapshots.py). One call on nvidia-h200, ~4-6 min:
#
#   bash benchmarks/device/round15_dev_snapshots.sh $OUT      (carry .corpus and .whl, as round14_preflight_truth.sh)
#
# Writes $OUT/round15-dev-snapshots.tar.xz.part0, part1, ... (cat them: one tar.xz of snapshots/NAME-rank0.pickle, truths.jsonl, logs) and $OUT/machine.txt.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
W=/tmp/round15; D=/tmp/round15-data; MAKE_DATA_S=150
. benchmarks/device/corpus_prelude.sh
timeout 420 python3 benchmarks/device/round15_dev_snapshots.py $W/dev --corpus .corpus --data $D --timeout 170 \
  --parallel 4 --half "${HALF:-dev}" 2>&1 | tee $W/dev.log; echo "snapshots rc=${PIPESTATUS[0]}"
ls -la $W/dev/snapshots 2>&1 | tail -20
(cd $W && tar cf - --exclude='*/runs/*' make_data.log dev.log dev 2>/dev/null | xz -T16 -6 > /tmp/r15.tar.xz)
# the device tool brings back files of at most 16 MiB: parts of 15 MiB (cat them to rebuild the archive)
split -b 15M -d -a 1 /tmp/r15.tar.xz "$OUT/round15-dev-snapshots.tar.xz.part"
ls -la "$OUT"; echo "done in $(( $(date +%s) - T0 )) s"
