"""``oomdoctor diagnose`` as a user runs it, on every run of the real-job corpus (docs/corpus/), with the code of
a given source tree; and the comparison of two such records (what a change did to every diagnosis).

    python benchmarks/corpus_outputs.py record SRC OUT.json     # SRC: a checkout's src/ (PYTHONPATH)
    python benchmarks/corpus_outputs.py compare BEFORE.json AFTER.json

``record`` keeps, per run, the JSON output, the text's first six lines at 80 columns and the exit status;
``compare`` prints the verdicts against the expected ones (docs/corpus/runs.json) and every field that differs,
leaving out where the run was unpacked (a temporary directory).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import tempfile
from collections import Counter
from pathlib import Path

CORPUS = Path(__file__).resolve().parents[1] / "docs" / "corpus"
_UNPACKED = ("inputs", "path")  # JSON fields naming the temporary directory


def record(src: str, out: str) -> None:
    runs = json.loads((CORPUS / "runs.json").read_text())
    env = {**os.environ, "PYTHONPATH": src, "COLUMNS": "80"}
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in runs.items():
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            run = Path(tmp) / name
            cmd = [sys.executable, "-m", "oomdoctor", "diagnose", str(run)]
            j = subprocess.run(cmd + ["--format", "json"], capture_output=True, text=True, env=env)
            t = subprocess.run(cmd, capture_output=True, text=True, env=env)
            res[name] = {"half": spec.get("half", "in-sample"), "expected": spec["verdict"],
                         "json": json.loads(j.stdout) if j.returncode == 0 else {"error": j.stderr[-500:]},
                         "text_head": t.stdout.replace(str(run), "RUN").splitlines()[:6], "rc": t.returncode}
    Path(out).write_text(json.dumps(res, indent=1) + "\n")


def _diff(x, y, path=""):
    if isinstance(x, dict) and isinstance(y, dict):
        return [d for k in sorted(set(x) | set(y), key=str) if k not in _UNPACKED
                for d in _diff(x.get(k), y.get(k), f"{path}.{k}")]
    if isinstance(x, list) and isinstance(y, list) and len(x) == len(y):
        return [d for i, (p, q) in enumerate(zip(x, y)) for d in _diff(p, q, f"{path}[{i}]")]
    return [] if x == y else [(path, x, y)]


def compare(before: str, after: str) -> None:
    b, a = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    for name, rec in (("before", b), ("after", a)):
        right = Counter(r["half"] for r in rec.values() if r["json"].get("verdict", {}).get("kind") == r["expected"])
        total = Counter(r["half"] for r in rec.values())
        print(f"{name}: verdict right on " + ", ".join(f"{right[h]} of {total[h]} {h}" for h in sorted(total)))
    changed = {n: _diff(b[n], a[n]) for n in b}
    fields = Counter(re.sub(r"\[\d+\]", "[]", p) for ds in changed.values() for p, _x, _y in ds)
    print(f"runs whose output changed: {sum(bool(d) for d in changed.values())} of {len(b)}")
    for f, k in fields.most_common():
        print(f"  {k:4d} {f}")


if __name__ == "__main__":
    commands = {"record": record, "compare": compare}
    if len(sys.argv) != 4 or sys.argv[1] not in commands:
        sys.exit("usage: corpus_outputs.py record SRC OUT.json | compare BEFORE.json AFTER.json")
    commands[sys.argv[1]](*sys.argv[2:])
