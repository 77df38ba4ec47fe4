#!/bin/bash
# Round 16 (issue 50): the corpus's three torchrun examples (FSDP2, tensor parallel, DDP), each run on ONE GPU
# (torchrun --nproc_per_node 1: no 2-GPU machine was lent), unchanged, peaks read after 2 optimizer steps by the
# corpus's step hook; compared with preflight --nproc-per-node 1 of the same command on the CPU.
set -u
root=$(pwd)
export PYTHONPATH=$root/benchmarks/preflight_corpus/truth_hook OOMTRUTH_OUT=$OUT/truths.jsonl OOMTRUTH_STEPS=2
nvidia-smi -L > $OUT/machine.txt; python -c "import torch; print(torch.__version__)" >> $OUT/machine.txt
c=$root/.corpus/pytorch+examples/distributed
run() {  # name, script, args...
  local name=$1; shift
  mkdir -p /tmp/w/$name && cd /tmp/w/$name
  OOMTRUTH_NAME=$name timeout 300 torchrun --standalone --nproc_per_node 1 "$@" > $OUT/$name.log 2>&1
  echo "$name rc=$?"; cd $root
}
run fsdp2 $c/FSDP2/example.py --mixed-precision
run tensor-parallel $c/tensor_parallelism/tensor_parallel_example.py
run ddp-torchrun $c/ddp-tutorial-series/multigpu_torchrun.py 1 10 --batch_size 32
grep -h '"completed": true' $OUT/truths.jsonl
