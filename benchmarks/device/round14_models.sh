#!/usr/bin/env bash
# Round 14, issue 54: jobs that hold several sets of weights, recorded under `oomdoctor run` on ONE H200, one call of
# about 4 minutes. Each job (scenarios/models_kinds.py) writes its own ground truth; the halves are fixed in
# docs/corpus/issue54_split.json (committed before any rule change).
#
#   runs      models-gan models-ema models-moco models-lora models-distill models-qlora models-rl-ref models-buffers:
#             `oomdoctor run --out RUN --no-diagnose -- python3 scenarios/models_kinds.py --kind K`, two at a time;
#             models-gan-late, models-lora-late: the same with a ring buffer that wraps (--max-entries), 12 steps, so
#             that Adam's state is made before the window (read without the sidecar: the older-recorder case)
#   needs     .whl/ carried (diffusers 0.42.1 and the package's dependencies the image lacks: dacite, zstandard,
#             pydantic, pydantic-core, annotated-types, typing-inspection, typing-extensions; cp312 manylinux x86_64)
#   out       $OUT/models-{0,1,2}.tar (each a tar of models-<run>.tar.xz: the run dir with rank0.pickle, its sidecar,
#             ground_truth.json, job.log), $OUT/models-runs.jsonl (exit code and seconds per run), $OUT/machine.txt
#
#   bash benchmarks/device/round14_models.sh "$OUT"
set -u
OUT=${1:?out dir}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
if [ -z "${ROUND14_INSTALLED:-}" ]; then  # round14_a.sh installs once for the parts it runs side by side
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
fi
export PYTHONPATH=/tmp/site
{ nvidia-smi -L; nproc; python3 --version; git log --oneline -1 2>/dev/null
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import diffusers; print('diffusers', diffusers.__version__)"; } > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
W=/tmp/round14; rm -rf $W; mkdir -p $W
: > "$OUT/models-runs.jsonl"

one() {  # one NAME KIND [oomdoctor run options...]
  local name=$1 kind=$2; shift 2
  local dir=$W/models-$name s=$(date +%s)
  mkdir -p "$dir"
  timeout 150 python3 -m oomdoctor run --out "$dir" --no-diagnose "$@" -- \
    python3 scenarios/models_kinds.py --kind "$kind" --ground-truth "$dir/ground_truth.json" ${EXTRA_ARGS:-} \
    > "$dir/job.log" 2>&1
  local rc=$?
  echo "{\"run\": \"models-$name\", \"exit_code\": $rc, \"seconds\": $(( $(date +%s) - s ))}" >> "$OUT/models-runs.jsonl"
  echo "models-$name rc=$rc $(( $(date +%s) - s ))s"; tail -3 "$dir/job.log"
}

# two at a time on the one GPU (small models: a few GiB each)
one gan gan & one ema ema & wait
one moco moco & one lora lora & wait
one distill distill & one qlora qlora & wait
one rl-ref rl-ref & one buffers buffers & wait
EXTRA_ARGS="--steps 12" one gan-late gan --max-entries 1500 &
EXTRA_ARGS="--steps 12" one lora-late lora --max-entries 12000 & wait

cd $W
i=0
for d in models-*; do
  tar cJf "$d.tar.xz" "$d" 2>/dev/null || echo "could not pack $d"
done
ls -la $W/*.tar.xz
for b in 0 1 2; do
  files=$(ls models-*.tar.xz | awk -v b=$b 'NR % 3 == b')
  [ -n "$files" ] && tar cf "$OUT/models-$b.tar" $files
done
echo "done in $(( $(date +%s) - T0 )) s"
