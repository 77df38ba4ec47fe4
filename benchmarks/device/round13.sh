#!/usr/bin/env bash
# Round 13, one part per device call (each fits the tool's 600 s limit):
#   trainer   (1 GPU)  issue 35 item 4: `oomdoctor fit` and auto_find_batch_size on the Trainer job, again with exactly
#                      K steps per trial (rounds 2 and 4 ran K + 1; round 12 reran the plain loop only)
#   torchrun  (2 GPUs) the same on the Trainer under torchrun --nproc_per_node=2
#   big       (CPUs)   issue 38 item 1: `oomdoctor diagnose` of a 2 GB snapshot (78 copies of `large`'s trace) against
#                      `pickle.load` of it, and of `large` itself, fresh processes (benchmarks/bench_cli.py)
# Needs .mwhl/ (the package's dependencies as cp312 wheels; the machine has no network) and, for `big`,
# .bench/fsdp2-gpt2-60steps-rank0.pickle.xz (the `large` snapshot), carried with the working tree.
#   bash benchmarks/device/round13.sh OUT PART
set -u
OUT=${1:?out dir}; PART=${2:?part}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile .mwhl/*.whl 2>&1 | tail -2
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
{ nvidia-smi -L; nproc; uptime; python3 --version; git log --oneline -1 2>/dev/null; } > $OUT/machine-$PART.txt 2>&1
cat $OUT/machine-$PART.txt
W=/tmp/round13; mkdir -p $W
case $PART in
  trainer)  timeout 540 python3 benchmarks/fit_vs_peers.py $W/fit-trainer --parts trainer > $W/fit-trainer.log 2>&1
            echo "fit rc=$?"; cat $W/fit-trainer/summary.md
            (cd $W && tar cJf $OUT/round13-fit-trainer.tar.xz fit-trainer fit-trainer.log) ;;
  torchrun) timeout 540 python3 benchmarks/fit_vs_peers.py $W/fit-torchrun --parts torchrun > $W/fit-torchrun.log 2>&1
            echo "fit rc=$?"; cat $W/fit-torchrun/summary.md
            (cd $W && tar cJf $OUT/round13-fit-torchrun.tar.xz fit-torchrun fit-torchrun.log) ;;
  big)      timeout 560 python3 benchmarks/bench_cli.py .bench/fsdp2-gpt2-60steps-rank0.pickle.xz --repeat 3 \
              --scale-to 2e9 --json $OUT/bench_cli.json > $OUT/bench_cli.log 2>&1
            echo "bench_cli rc=$?"; tail -40 $OUT/bench_cli.log ;;
  *) echo "unknown part $PART"; exit 2 ;;
esac
uptime
