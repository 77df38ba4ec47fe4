#!/usr/bin/env bash
# Round 15 (issue 50): GPU truths of the corpus's third addition (split.json "additions", drawn 2026-11-29 before
# any preflight result was read), then memory snapshots of the same runs. One call on nvidia-h200, ~5 min:
#
#   bash benchmarks/device/round15_new.sh $OUT      (carry .corpus and .whl)
#
# Writes $OUT/truths-new.jsonl (truth.py's lines: the truth hook alone, as truths-one.jsonl was taken),
# $OUT/round15-new.tar.xz (logs, hook lines, snapshots/NAME-rank0.pickle) and $OUT/machine.txt.
set -u
OUT=${1:?out dir}
NEW="nanogpt-gpt2-owt nanogpt-shakespeare-char nanogpt-bench pytorch-examples-fast-neural-style
 pytorch-examples-mnist-forward-forward peft-delora-llama peft-shira-llama dino-vit-small
 torchvision-ref-similarity-resnet50"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
W=/tmp/round15n; D=/tmp/round15n-data
. benchmarks/device/corpus_prelude.sh
# dino sets MASTER_PORT 29500 itself: it runs alone, after the others
timeout 240 python3 benchmarks/preflight_corpus/truth.py $W/truth --corpus .corpus --data $D --timeout 200 --parallel 4 \
  --only $(echo $NEW | tr ' ' '\n' | grep -v dino) 2>&1 | tee $W/truth.log
timeout 200 python3 benchmarks/preflight_corpus/truth.py $W/truth --corpus .corpus --data $D --timeout 180 \
  --only dino-vit-small 2>&1 | tee -a $W/truth.log
cp $W/truth/truths.jsonl "$OUT/truths-new.jsonl"
echo "truths done $(( $(date +%s) - T0 )) s"
timeout 240 python3 benchmarks/device/round15_dev_snapshots.py $W/snap --corpus .corpus --data $D --timeout 200 \
  --parallel 4 --only $(echo $NEW | tr ' ' '\n' | grep -v dino) 2>&1 | tee $W/snap.log
(cd $W && tar cf - --exclude='*/runs/*' make_data.log truth.log snap.log truth snap 2>/dev/null | xz -T16 -6 > "$OUT/round15-new.tar.xz")
ls -la "$OUT"; echo "done in $(( $(date +%s) - T0 )) s"
