#!/usr/bin/env bash
# The second GPU round of this session (4 GPUs at once, one lane per GPU group), as run through the device tool:
#   lane A, GPU 0:    fit_vs_peers --parts trainer, then --parts verify          (issue 35 item 4)
#   lane B, GPU 1:    fit_vs_peers --parts plain, then the chunked-loss runs of scenarios/new_kinds.py (issue 36)
#   lane C, GPUs 2,3: fit_vs_peers --parts torchrun, then preflight_vs_gpu (issue 42) and
#                     inference_prefill_window (issue 41) on GPU 2, and the new GPU tests
# A GPU that `fit` drives to its limit runs nothing else at the same time.
set -u
OUT=${1:?out dir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
W=/tmp/round2; mkdir -p $W
(
  CUDA_VISIBLE_DEVICES=0 timeout 330 python3 benchmarks/fit_vs_peers.py $W/fit-trainer --parts trainer
  CUDA_VISIBLE_DEVICES=0 timeout 200 python3 benchmarks/fit_vs_peers.py $W/fit-verify --parts verify
) > $W/laneA.log 2>&1 &
(
  CUDA_VISIBLE_DEVICES=1 timeout 330 python3 benchmarks/fit_vs_peers.py $W/fit-plain --parts plain
  mkdir -p $W/nk
  for s in small large; do
    d=$W/nk/new-kinds-chunked-loss-$s; mkdir -p $d
    (cd scenarios && CUDA_VISIBLE_DEVICES=1 timeout 120 python3 new_kinds.py --kind chunked-loss --size $s \
       --snapshot $d/rank{rank}.pickle --ground-truth $d/ground_truth.json > $d/job.log 2>&1)
  done
) > $W/laneB.log 2>&1 &
(
  CUDA_VISIBLE_DEVICES=2,3 timeout 330 python3 benchmarks/fit_vs_peers.py $W/fit-torchrun --parts torchrun
  CUDA_VISIBLE_DEVICES=2 timeout 150 python3 benchmarks/preflight_vs_gpu.py $W/preflight
  CUDA_VISIBLE_DEVICES=2 timeout 120 python3 scenarios/inference_prefill_window.py --variant all --out $W/window
  CUDA_VISIBLE_DEVICES=2 timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/gpu/test_job_counters_gpu.py tests/gpu/test_loop_gpu.py
) > $W/laneC.log 2>&1 &
wait
cd $W
tar cJf $OUT/fit.tar.xz fit-* laneA.log laneB.log
tar cJf $OUT/preflight-window.tar.xz preflight window laneC.log
(cd nk && for d in *; do tar cJf $d.tar.xz $d; done; tar cf $OUT/chunked.tar *.tar.xz)
ls -la $OUT; tail -5 laneA.log laneB.log laneC.log
