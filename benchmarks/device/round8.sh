#!/usr/bin/env bash
# The eighth round (issue 38, no GPU needed: the device machine's idle CPUs): diagnose and simulate on `large`
# against pickle.load, this round's tree beside 1341fbb's (the session's start), alternated in fresh processes.
# Needs .bench/ (carried): the large snapshot (.xz) and 1341fbb's src/ in .bench/before/src.
set -u
OUT=${1:?out dir}
export PYTHONUNBUFFERED=1
python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.bench/fsdp2-gpt2-60steps-rank0.pickle.xz'), open('/tmp/large.pickle','wb'))"
nproc; uptime
timeout 250 python3 benchmarks/diagnose_ab.py /tmp/large.pickle 7 .bench/before/src src > $OUT/diagnose_ab.txt 2>&1; echo "diagnose_ab rc=$?"
cat $OUT/diagnose_ab.txt
timeout 300 python3 benchmarks/bench_simulate_e2e.py .bench/fsdp2-gpt2-60steps-rank0.pickle.xz --repeat 7 \
  --src before=.bench/before/src --src after=src --json $OUT/bench_simulate_e2e.json > $OUT/simulate_e2e.txt 2>&1
echo "simulate rc=$?"; tail -25 $OUT/simulate_e2e.txt
