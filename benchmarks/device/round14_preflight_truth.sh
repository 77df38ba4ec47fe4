#!/usr/bin/env bash
# Round 14, issue 50 item 5: the GPU truths of the public-script corpus (benchmarks/preflight_corpus/manifest.json).
# Every entry runs unmodified (python SCRIPT ARGS, or torchrun for the 2-GPU ones) with a global optimizer step
# hook put on PYTHONPATH (benchmarks/preflight_corpus/truth_hook/sitecustomize.py) that reads
# torch.cuda.max_memory_allocated / max_memory_reserved after K optimizer steps and ends the process.
#
#   bash benchmarks/device/round14_preflight_truth.sh OUT one   # the 1-GPU entries, on nvidia-h200 (~6-8 min)
#   bash benchmarks/device/round14_preflight_truth.sh OUT two   # the 2-GPU entries, on nvidia-h200-x2 (~3-4 min)
#
# Needs, carried with the working tree: .corpus/ (the fetched scripts: benchmarks/preflight_corpus/README.md) and
# .whl/corpus/ (datasets 5.2.0, dill 0.4.1, multiprocess 0.70.19, evaluate 0.4.6, timm 1.0.28 as py3 wheels; the
# machine has no network). Data are made here (make_data.py, seeded). Each run is guarded by `timeout`; a failure
# is logged and the others go on. Writes to OUT: truths-PART.jsonl (one line per entry), machine-PART.txt and
# round14-preflight-truth-PART.tar.xz (every run's log and hook lines).
set -u
OUT=${1:?out dir}; PART=${2:-one}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
T0=$(date +%s)
mkdir -p "$OUT"
if ls .whl/corpus/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/corpus/*.whl \
    2>&1 | tail -3 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/corpus/: datasets, evaluate and timm 1.0.28 missing (carry .whl)"
fi
{ nvidia-smi -L; nproc; python3 --version; git log --oneline -1 2>/dev/null
  python3 -c 'import torch, transformers, accelerate, lightning, peft, timm, datasets; print("torch", torch.__version__, "transformers", transformers.__version__, "accelerate", accelerate.__version__, "lightning", lightning.__version__, "peft", peft.__version__, "timm", timm.__version__, "datasets", datasets.__version__)'
  ls .corpus; } > "$OUT/machine-$PART.txt" 2>&1
cat "$OUT/machine-$PART.txt"
W=/tmp/round14; D=/tmp/round14-data; mkdir -p $W
timeout 150 python3 benchmarks/preflight_corpus/make_data.py $D > $W/make_data.log 2>&1; echo "make_data rc=$? $(( $(date +%s) - T0 )) s"
case $PART in
  one) timeout 400 python3 benchmarks/preflight_corpus/truth.py $W/one --corpus .corpus --data $D --nproc 1 \
         --timeout 170 --parallel 4 2>&1 | tee $W/one.log; echo "truth rc=${PIPESTATUS[0]}" ;;
  two) timeout 200 python3 benchmarks/preflight_corpus/truth.py $W/two --corpus .corpus --data $D --nproc 2 \
         --timeout 120 --parallel 1 2>&1 | tee $W/two.log; echo "truth rc=${PIPESTATUS[0]}" ;;
  *) echo "unknown part $PART (one | two)"; exit 2 ;;
esac
cp $W/$PART/truths.jsonl "$OUT/truths-$PART.jsonl" 2>/dev/null || echo "no truths.jsonl"
(cd $W && tar cJf "$OUT/round14-preflight-truth-$PART.tar.xz" --exclude='*/runs/*' make_data.log $PART.log $PART 2>/dev/null)
echo "done in $(( $(date +%s) - T0 )) s"
