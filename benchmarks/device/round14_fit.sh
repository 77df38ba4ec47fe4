#!/usr/bin/env bash
# Round 14, issue 49 item 6, one device call on ONE H200 (about 4-5 minutes, 7 at most; every part guarded by
# `timeout`, a failure is logged and the others go on):
#   vit      `oomdoctor fit` started at 1 on a ViT-B/16 training job (scenarios/vit_job.py: torchvision vit_b_16,
#            synthetic 224x224 images made on the GPU, AdamW, bf16 autocast) under a memory-fraction cap of
#            CAP_GIB (default 8: the edge near 100, each trial seconds long; the job and its allocations
#            are the real ones, the room is smaller), against the doubling search on the same job (`oomdoctor fit
#            --no-record --start 1`: the same trials, no replayed guess) and accelerate's
#            find_executable_batch_size (auto_find_batch_size's search, x0.9 per OOM, in one process) from 512.
#            The table's raw data: fit's and the doubling search's trials, outcomes and seconds, the peer's.
#   gputest  tests/gpu/test_loop_gpu.py -k "catches or refuses": a job that catches its OOM and exits 0 is 'oom'
#            (memory_stats num_ooms), on the GPU (about 1 minute).
#   bash benchmarks/device/round14_fit.sh OUT [PARTS]        PARTS: vit (default) | vit,gputest | gputest
# Outputs under OUT: round14-fit.tar.xz (every JSON, log and exit record), round14-snapshots.tar.xz (the recorded
# trial's snapshot, when under 15 MB), summary.md (the table's rows), machine.txt, gputest.log when run.
# No carry: the package is imported from src/ (PYTHONPATH), its dependencies from the installed wheel.
set -u
OUT=${1:?out dir}; PARTS=${2:-vit}; CAP_GIB=${CAP_GIB:-8}
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
python3 -c "import oomdoctor, click, numpy" 2>/dev/null || \
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
{ nvidia-smi -L; nproc; uptime; python3 --version; git log --oneline -1 2>/dev/null
  python3 -c "import torch, torchvision, accelerate; print(torch.__version__, torchvision.__version__, accelerate.__version__)"
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
W=/tmp/round14; rm -rf $W; mkdir -p $W
case ",$PARTS," in *,vit,*)
  timeout 420 python3 benchmarks/fit_vs_peers.py $W/vit --parts vit --high 4096 --timeout 170 \
    --vit-cap-gib "$CAP_GIB" --vit-peer-start 512 --vit-peer-timeout 60 > $W/vit.log 2>&1
  echo "vit rc=$?"; cat $W/vit/summary.md 2>/dev/null; cp $W/vit/summary.md "$OUT/summary.md" 2>/dev/null
  tail -5 $W/vit.log ;;
esac
case ",$PARTS," in *,gputest,*)
  timeout 150 python3 -m pytest -m gpu -q tests/gpu/test_loop_gpu.py -k "catches or refuses" -p no:cacheprovider \
    > "$OUT/gputest.log" 2>&1
  echo "gputest rc=$?"; tail -5 "$OUT/gputest.log" ;;
esac
(cd $W && tar cJf "$OUT/round14-fit.tar.xz" --exclude='*.pickle' . 2>/dev/null)
# the recorded trial's snapshot (fit's guess comes from its replay), apart: dropped if over 15 MB (16 MiB come back)
(cd $W && find . -name '*.pickle' | tar cJf "$OUT/round14-snapshots.tar.xz" -T - 2>/dev/null)
[ "$(stat -c %s "$OUT/round14-snapshots.tar.xz" 2>/dev/null || echo 0)" -gt 15000000 ] && \
  { rm -f "$OUT/round14-snapshots.tar.xz"; echo "snapshots over 15 MB: not kept" >> "$OUT/machine.txt"; }
ls -la "$OUT"; uptime
