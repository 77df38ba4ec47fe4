#!/usr/bin/env bash
# Round 10 (issue 38 item 1, no GPU needed: the device machine's idle CPUs): `oomdoctor diagnose` of the `large`
# snapshot against `pickle.load`, the tree before (dfa676e) beside this branch's (h-readspeed2: the process ends with
# os._exit and keeps the decoded snapshot instead of freeing it), alternated in fresh processes, 9 repetitions.
# Needs .bench/ (carried): the large snapshot (.xz) and dfa676e's src/ in .bench/before/src
#   (git archive dfa676e src | tar -x -C .bench/before).
# Usage: bash benchmarks/device/round10_speed.sh "$OUT"      (about 2 minutes on 16 idle CPUs; writes 3 files)
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
test -d .bench/before/src/oomdoctor || { echo "missing .bench/before/src (git archive dfa676e src)"; exit 2; }
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.bench/fsdp2-gpt2-60steps-rank0.pickle.xz'), open('/tmp/large.pickle','wb'))"
{ nproc; uptime; python3 --version; python3 -c "import numpy; print('numpy', numpy.__version__)"; } > $OUT/machine.txt 2>&1
cat $OUT/machine.txt
timeout 420 python3 benchmarks/diagnose_ab.py /tmp/large.pickle 9 .bench/before/src src \
  --json $OUT/diagnose_ab.json > $OUT/diagnose_ab.txt 2>&1; echo "diagnose_ab rc=$?"
cat $OUT/diagnose_ab.txt
uptime >> $OUT/machine.txt
