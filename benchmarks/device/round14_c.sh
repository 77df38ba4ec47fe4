#!/usr/bin/env bash
# Round 14, call C on TWO H200s: issue 49's calibration part two (round14_calib.sh two: fsdp2-ac-edge and the real
# 2-rank 1F1B stage 0) and issue 50's 2-GPU public scripts (round14_preflight_truth.sh two) side by side: memory is
# measured per process (the calib kinds under caps), and the corpus runs use torchrun --standalone (a free port), so
# neither disturbs the other's numbers. Carry .whl and .corpus.
#   bash benchmarks/device/round14_c.sh OUT [CALIB_BUDGET_S]
set -u
OUT=${1:?out dir}; BUDGET=${2:-150}
python3 -m pip install -q --no-index --no-deps --no-compile .whl/dacite*.whl .whl/pydantic*.whl .whl/zstandard*.whl \
  .whl/annotated_types*.whl .whl/typing_inspection*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
mkdir -p /tmp/truth-out
(bash benchmarks/device/round14_preflight_truth.sh /tmp/truth-out two > /tmp/truth-out/driver.log 2>&1) &
bash benchmarks/device/round14_calib.sh "$OUT" two "$BUDGET"
wait
tail -12 /tmp/truth-out/driver.log
(cd /tmp/truth-out && tar cf "$OUT/truth-two.tar" .)
ls -la "$OUT"
