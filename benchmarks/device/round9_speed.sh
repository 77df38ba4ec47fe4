#!/usr/bin/env bash
# Round 9 (issue 38 item 1, no GPU needed: the device machine's idle CPUs): `oomdoctor diagnose` of the `large`
# snapshot against `pickle.load`, the tree before (8f56470) beside this branch's, alternated in fresh processes,
# 9 repetitions; with --blas, also the after tree with OPENBLAS/OMP/MKL_NUM_THREADS set to the CPU count (the
# setting as it was) and the before tree with them set to 1. Then the stages of one diagnosis in one process, per tree.
# Needs .bench/ (carried): the large snapshot (.xz) and 8f56470's src/ in .bench/before/src
#   (git archive 8f56470 src | tar -x -C .bench/before).
# Usage: bash benchmarks/device/round9_speed.sh "$OUT"      (about 3 minutes on 16 idle CPUs; writes 4 files)
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
test -d .bench/before/src/oomdoctor || { echo "missing .bench/before/src (git archive 8f56470 src)"; exit 2; }
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.bench/fsdp2-gpt2-60steps-rank0.pickle.xz'), open('/tmp/large.pickle','wb'))"
{ nproc; uptime; python3 --version; python3 -c "import numpy; print('numpy', numpy.__version__)"; } > $OUT/machine.txt 2>&1
cat $OUT/machine.txt
timeout 420 python3 benchmarks/diagnose_ab.py /tmp/large.pickle 9 .bench/before/src src --blas \
  --json $OUT/diagnose_ab.json > $OUT/diagnose_ab.txt 2>&1; echo "diagnose_ab rc=$?"
cat $OUT/diagnose_ab.txt
for tree in before after; do
  src=src; [ $tree = before ] && src=.bench/before/src
  for i in 1 2 3; do PYTHONPATH=$src timeout 60 python3 benchmarks/diagnose_stages.py /tmp/large.pickle; echo; done
done > $OUT/stages.txt 2>&1; echo "stages rc=$?"
uptime >> $OUT/machine.txt
