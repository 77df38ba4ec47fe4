#!/usr/bin/env bash
# Mutation testing of src/oomdoctor/simulate/ on a lent machine's CPUs (issue 35: simulate/ joins the mutation
# scope; docs/testing.md). The development machine has 2 CPUs: generating simulate/'s 4,600 mutants and running them
# takes hours there, minutes on 16.
#
#   bash benchmarks/device/mutation_simulate.sh OUT [SAMPLE]    # SAMPLE: mutants drawn at random (0: all)
#   bash benchmarks/device/mutation_simulate.sh OUT NAMES       # NAMES: a file of the mutants to run (a sample
#                                                                # drawn before, the same before and after a change)
#
# mutmut's statistics step (which tests reach which function) runs the whole unit suite in one process; on the lent
# machine it did not finish in 380 s. Where .mut/ is carried (the narrowed pyproject.toml and the mutants/
# mutmut-stats.json of a run on the development machine, same tree), they are used as they are: mutmut loads the
# statistics and goes straight to the mutants (it collects them again only for tests it has not seen, or when the
# pyproject's test settings differ).
#
# Needs: .mwhl/ (mutmut 3.8.1 and the package's and tests' dependencies as wheels: the machine has no network) and
# .mshared/ (a copy of ../shared/snapshots and megatron_ci), carried with the working tree. The package itself is not
# installed for the subprocesses; the tests import mutmut's copy (mutants/src). [tool.mutmut] is narrowed to simulate/ here, on the
# lent copy only. Writes OUT/mutation.json (benchmarks/mutation.py's summary), OUT/results.txt.xz (`mutmut results
# --all true`), OUT/run.log.xz.
set -u
OUT=${1:?OUT}; SAMPLE=${2:-0}
if [ -f "$SAMPLE" ]; then PICK=(--names "$SAMPLE"); else PICK=(--sample "$SAMPLE"); fi
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile .mwhl/*.whl 2>&1 | tail -2
# the tests that start `python -m oomdoctor` in a subprocess import this unmutated copy, as on the development
# machine (an editable install there); the tests themselves import mutmut's mutated copy (mutants/src) first
python3 -m pip install -q --no-index --no-deps --no-build-isolation . 2>&1 | tail -2
if [ -f .mut/pyproject.toml ]; then
  cp .mut/pyproject.toml pyproject.toml; mkdir -p mutants; cp .mut/mutmut-stats.json mutants/
else
python3 - <<'PY'
import re, pathlib
p = pathlib.Path("pyproject.toml"); t = p.read_text()
t = re.sub(r'source_paths = \[[^\]]*\]', 'source_paths = ["src/oomdoctor/simulate/"]', t, count=1)
# preflight's tests reach no simulate/ code (they failed on a CUDA build of torch with no visible device, "no
# CUDA-capable device", until preflight/script.py patched torch.accelerator; kept out as they add nothing here); test_readme reads .ci/run, which mutmut does not copy into mutants/; test_startup
# counts the modules a diagnosis imports, and mutmut's trampolines import more)
t = t.replace('"-k", "not dask"', '"-k", "not dask and not preflight and not readme and not test_a_healthy_diagnosis_imports_no_planner"', 1)
p.write_text(t)
PY
fi
grep -n "source_paths" pyproject.toml
export OOMDOCTOR_SHARED=$PWD/.mshared
mkdir -p .pybin && printf '#!/bin/sh\nexec %s "$@"\n' "$(command -v python3)" > .pybin/python && chmod +x .pybin/python
export PATH=$PWD/.pybin:$PATH  # tests run `python` (a wrapper: a symlink would lose the venv)
export CUDA_VISIBLE_DEVICES=""  # the unit tests are the CPU suite (test_capture expects no CUDA device)
start=$(date +%s)
timeout "${BUDGET_S:-520}" python3 benchmarks/mutation.py --max-children "$(nproc)" "${PICK[@]}" --out "$OUT/mutation.json" > "$OUT/run.log" 2>&1
echo "rc=$? seconds=$(( $(date +%s) - start ))"
tail -25 "$OUT/run.log"
python3 -m mutmut results --all true 2>/dev/null | xz -9 > "$OUT/results.txt.xz"
xz -9 "$OUT/run.log"
