#!/usr/bin/env bash
# Round 14, issue 49 items 3-5 (h49-calib): record the new kinds of job, sweep each, rerun every OOM with each
# allocator setting diagnose tries for it, and run the pending answers of what fits. One call per part:
#   one  (1 x H200, ~5 min)  every single-GPU kind of scenarios/round14_jobs.py at once (each process under its own
#                            memory-fraction cap, 8-14 GiB, together below the GPU's memory), gnn-varsize-cap
#                            (scenarios/graphsage_gc.py), then the pending answers alone (docs/corpus/round14_pending.json)
#   two  (2 x H200, ~4 min)  fsdp2-ac-edge and stage0-1f1b-real under torchrun
# The kinds' halves (tuning / held-out) are in docs/corpus/round14_split.json, committed before any was recorded.
# Needs the oomdoctor package importable (installed from the tree's wheel, or .mwhl/ carried: the package's
# dependencies as wheels, then `pip install .`); transformers for llama-256k-first-backward and the pending
# generate() runs. Writes at most 5 files to OUT: machine-PART.txt, round14-PART-rows.jsonl (one row per process:
# kind, half, stage, batch, setting, exit code, the job's own truth), round14-PART-rec.tar.xz (the recordings:
# snapshots, sidecars, ground truth, job logs), round14-PART-logs.tar.xz (every process's log), round14-PART.log.
#   bash benchmarks/device/round14_calib.sh OUT [one|two] [BUDGET_S]
set -u
OUT=${1:?out dir}; PART=${2:-one}; BUDGET=${3:-300}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
mkdir -p "$OUT"
if ! python3 -c "import oomdoctor" 2>/dev/null; then
  [ -d .mwhl ] && python3 -m pip install -q --no-index --no-deps --no-compile .mwhl/*.whl 2>&1 | tail -2
  python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
fi
{ nvidia-smi -L; nproc; uptime; python3 --version
  python3 -c "import torch, oomdoctor; print('torch', torch.__version__, 'oomdoctor', oomdoctor.__version__)"
  git log --oneline -1 2>/dev/null; } > "$OUT/machine-$PART.txt" 2>&1
cat "$OUT/machine-$PART.txt"
W=/tmp/round14-$PART; rm -rf "$W"; mkdir -p "$W"
timeout $((BUDGET + 150)) python3 scenarios/round14_calib.py --out "$W" --part "$PART" --budget-s "$BUDGET" \
  > "$OUT/round14-$PART.log" 2>&1
echo "driver rc=$?"
cp "$W/rows.jsonl" "$OUT/round14-$PART-rows.jsonl" 2>/dev/null || echo "no rows"
[ -d "$W/rec" ] && (cd "$W" && tar cJf "$OUT/round14-$PART-rec.tar.xz" rec)
[ -d "$W/tmp" ] && (cd "$W" && find tmp -name job.log | tar cJf "$OUT/round14-$PART-logs.tar.xz" -T -)
# the summary: each kind's sweep, and every run's exit code
python3 - "$OUT/round14-$PART-rows.jsonl" <<'EOF' || true
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
for r in rows:
    if r.get("stage") in ("sweep", "done", "probe-failed", "skipped-budget"):
        print(r)
    elif r.get("stage"):
        print(f"{r.get('kind')} {r.get('stage')} b={r.get('batch')} conf={r.get('alloc_conf') or '-'} "
              f"rc={r.get('exit_code')} reserved={r.get('max_memory_reserved')} {r.get('wall_s')}s "
              f"{(r.get('oom') or '')[:70]}")
EOF
ls -la "$OUT"; uptime
