#!/bin/bash
# On a machine with 2 GPUs: the scenario GPU tests, then the overhead benchmark. Results in $OUT.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/oomdoctor-gpu}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" | tee -a "$OUT/gpu.txt"
OOMDOCTOR_SCENARIO_LOG="$OUT/scenarios.jsonl" python3 -m pytest -m gpu tests/gpu -v -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gpu_tests.log" | tail -40
