#!/usr/bin/env bash
# The ninth round, simulate only (issue 38 item 2, no GPU needed: the device machine's idle CPUs): `oomdoctor
# simulate large` against pickle.load, this branch's tree beside 8f56470's (the round's start), alternated in fresh
# processes, then the same stage by stage. Needs .bench/ (carried): the large snapshot (.xz) and 8f56470's src/ in
# .bench/before/src. About 2 minutes on 16 idle CPUs (timeouts 300 + 2 x 120 s). Results (7 files) in $OUT.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.bench/fsdp2-gpt2-60steps-rank0.pickle.xz'), open('/tmp/large.pickle','wb'))"
(nproc; uptime; python3 --version) > $OUT/machine.txt 2>&1; cat $OUT/machine.txt
# issue 38's metric: events / (simulate wall - pickle.load wall), medians of 9 alternated fresh processes
timeout 300 python3 benchmarks/bench_simulate_e2e.py /tmp/large.pickle --repeat 9 \
  --src before=.bench/before/src --src after=src --json $OUT/bench_simulate_e2e.json > $OUT/simulate_e2e.txt 2>&1
echo "simulate_e2e rc=$?"; tail -30 $OUT/simulate_e2e.txt
# where the seconds go, stage by stage (medians of 5 fresh processes each)
for t in before after; do
  src=$([ $t = before ] && echo .bench/before/src || echo src)
  PYTHONPATH=$src timeout 120 python3 benchmarks/simulate_stages.py /tmp/large.pickle --repeat 5 \
    --json $OUT/stages_$t.json > $OUT/stages_$t.txt 2>&1; echo "stages $t rc=$?"; cat $OUT/stages_$t.txt
done
