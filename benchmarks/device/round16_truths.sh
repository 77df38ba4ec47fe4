#!/bin/bash
# Round 16 (issue 50): GPU truths of the two test scripts whose refusals this round fixed (a sparse COO delta
# weight's gradient, peft SHiRA's; DTensor shards initialised at random, FSDP2's reset_parameters), read after 2
# optimizer steps by the corpus's global step hook (benchmarks/preflight_corpus/truth_hook), the scripts unchanged.
set -u
root=$(pwd)
export PYTHONPATH=$root/benchmarks/preflight_corpus/truth_hook OOMTRUTH_OUT=$OUT/truths.jsonl OOMTRUTH_STEPS=2
cd tests/data/preflight_scripts
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > $OUT/machine.txt
python -c "import torch; print(torch.__version__, torch.version.cuda, torch.backends.cudnn.version())" >> $OUT/machine.txt
OOMTRUTH_NAME=sparse_delta python sparse_delta.py > $OUT/sparse_delta.log 2>&1; echo "sparse_delta rc=$?"
OOMTRUTH_NAME=fsdp2_reset_1 torchrun --standalone --nproc_per_node 1 fsdp2_reset.py > $OUT/fsdp2_reset_1.log 2>&1; echo "fsdp2_reset_1 rc=$?"
cat $OUT/truths.jsonl
# the FSDP2 one with a memory snapshot of its 2 steps (preflight is +10% on it: compared event by event)
if [ "${SNAP:-0}" = 1 ]; then
  export PYTHONPATH=$root/benchmarks/device/snapshot_hook OOMSNAP_OUT=$OUT/snapshots OOMTRUTH_OUT=$OUT/truths_snap.jsonl
  mkdir -p $OUT/snapshots
  OOMTRUTH_NAME=fsdp2_reset_1 torchrun --standalone --nproc_per_node 1 fsdp2_reset.py > $OUT/fsdp2_reset_snap.log 2>&1; echo "fsdp2_reset snap rc=$?"
  cat $OUT/truths_snap.jsonl
fi
