#!/usr/bin/env bash
# Round 14, call A on ONE H200 (about 7 minutes): issue 49's calibration part one (round14_calib.sh one) and issue 54's
# kinds (round14_models.sh) side by side. Both measure memory per process (each calib kind under its own
# memory-fraction cap, the models' jobs a few GiB each, all together far below the GPU's 139 GiB), so running them at
# once changes no peak; only their wall times share the machine. The package and the carried wheels are installed once,
# before either starts. Carry .whl (the package's dependencies and diffusers, cp312). Writes to OUT: calib's five files
# (machine-one.txt, round14-one-*.{jsonl,tar.xz}, round14-one.log) and models.tar (the models part's OUT).
#   bash benchmarks/device/round14_a.sh OUT [CALIB_BUDGET_S]
set -u
OUT=${1:?out dir}; BUDGET=${2:-270}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-compile .whl/dacite*.whl .whl/pydantic*.whl .whl/zstandard*.whl \
  .whl/annotated_types*.whl .whl/typing_inspection*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
export ROUND14_INSTALLED=1
mkdir -p /tmp/models-out
(bash benchmarks/device/round14_models.sh /tmp/models-out > /tmp/models-out/driver.log 2>&1; echo "models rc=$?" >> /tmp/models-out/driver.log) &
bash benchmarks/device/round14_calib.sh "$OUT" one "$BUDGET"
wait
tail -30 /tmp/models-out/driver.log
(cd /tmp/models-out && tar cf "$OUT/models.tar" .)
ls -la "$OUT"
