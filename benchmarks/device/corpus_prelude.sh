# Sourced by the corpus's device scripts (round15_dev_snapshots.sh, round15_new.sh) after they set OUT, W (a fresh
# work folder) and D (the data folder): the corpus's wheels (.whl/corpus, carried) on PYTHONPATH, the machine's GPU
# and versions in $OUT/machine.txt, and the generated data sets in $D (make_data.py, seeded; timeout ${MAKE_DATA_S:-200} s).
T0=$(date +%s)
mkdir -p "$OUT"
if ls .whl/corpus/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/corpus/*.whl \
    2>&1 | tail -3 && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ nvidia-smi -L; python3 -c 'import torch, transformers, peft; print("torch", torch.__version__, "transformers", transformers.__version__, "peft", peft.__version__)'; } > "$OUT/machine.txt" 2>&1
rm -rf "$W"; mkdir -p "$W"
timeout "${MAKE_DATA_S:-200}" python3 benchmarks/preflight_corpus/make_data.py "$D" > "$W/make_data.log" 2>&1
echo "make_data rc=$? $(( $(date +%s) - T0 )) s"
