#!/usr/bin/env bash
# Round 11 (issue 38 items 1 and 2, no GPU needed: the device machine's idle CPUs): `oomdoctor diagnose` and
# `oomdoctor simulate` of the `large` snapshot against `pickle.load`, the tree at this round's start (1f9e915, in
# .bench/start/src: `git archive 1f9e915 src | tar -x -C .bench/start`) beside this tree, alternated in fresh
# processes, 9 repetitions each; then simulate's stages for this tree.
# Needs .bench/ (carried): the large snapshot (.xz) and .bench/start/src.
# Usage: bash benchmarks/device/round11_speed.sh "$OUT"      (about 5 minutes on 16 idle CPUs; writes 7 files)
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
test -d .bench/start/src/oomdoctor || { echo "missing .bench/start/src (git archive 1f9e915 src)"; exit 2; }
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.bench/fsdp2-gpt2-60steps-rank0.pickle.xz'), open('/tmp/large.pickle','wb'))"
{ nproc; uptime; python3 --version; python3 -c "import numpy; print('numpy', numpy.__version__)"; } > $OUT/machine.txt 2>&1
cat $OUT/machine.txt
# issue 38 item 1: diagnose / pickle.load, medians of 9 alternated fresh processes
timeout 240 python3 benchmarks/diagnose_ab.py /tmp/large.pickle 9 .bench/start/src src \
  --json $OUT/diagnose_ab.json > $OUT/diagnose_ab.txt 2>&1; echo "diagnose_ab rc=$?"
cat $OUT/diagnose_ab.txt
# issue 38 item 2: events / (simulate wall - pickle.load wall), medians of 9 alternated fresh processes
timeout 240 python3 benchmarks/bench_simulate_e2e.py /tmp/large.pickle --repeat 9 \
  --src before=.bench/start/src --src after=src --json $OUT/bench_simulate_e2e.json > $OUT/simulate_e2e.txt 2>&1
echo "simulate_e2e rc=$?"; tail -30 $OUT/simulate_e2e.txt
PYTHONPATH=src timeout 90 python3 benchmarks/simulate_stages.py /tmp/large.pickle --repeat 5 \
  --json $OUT/stages_after.json > $OUT/stages_after.txt 2>&1; echo "stages rc=$?"; cat $OUT/stages_after.txt
uptime >> $OUT/machine.txt
