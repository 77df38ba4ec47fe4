"""``oomdoctor diagnose --format json`` of every snapshot in ``shared/snapshots`` (each file alone, then each
directory as one job) and every run of the real-job corpus (``docs/corpus/*.tar.xz``, each unpacked directory as
one job), with the code of a given source tree; and the byte-for-byte comparison of two such records. A change
that only makes reading faster must leave every byte of every diagnosis as it was (docs/benchmarks.md).

    python benchmarks/diagnose_bytes.py record SRC OUT.json     # SRC: a checkout's src/ (PYTHONPATH)
    python benchmarks/diagnose_bytes.py compare BEFORE.json AFTER.json

``record`` keeps, per input, the exit status, standard output (the JSON, with the temporary directory a corpus
run was unpacked to replaced by ``RUN``) and standard error. ``compare`` prints every input whose bytes differ
and exits 1 if any does. The JSON holds no timing field, so nothing is left out.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "docs" / "corpus"
SHARED = Path(os.environ.get("OOMDOCTOR_SHARED", ROOT.parent / "shared")) / "snapshots"


def _inputs() -> list[Path]:
    files = sorted(p for p in SHARED.rglob("*") if p.is_file() and (".pickle" in p.name or p.suffix == ".json"))
    dirs = sorted({p.parent for p in files})
    return files + dirs


def _diagnose(path: Path, env: dict, unpacked: str | None = None) -> dict:
    p = subprocess.run([sys.executable, "-m", "oomdoctor", "diagnose", str(path), "--format", "json"],
                       capture_output=True, text=True, env=env)
    out, err = p.stdout, p.stderr
    if unpacked:
        out, err = out.replace(unpacked, "RUN"), err.replace(unpacked, "RUN")
    return {"rc": p.returncode, "stdout": out, "stderr": err,
            "sha256": hashlib.sha256(out.encode()).hexdigest()}


def record(src: str, out: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.path.abspath(src), "COLUMNS": "80"}
    res = {}
    for p in _inputs():
        res[str(p.relative_to(SHARED))] = _diagnose(p, env)
        print(p.relative_to(SHARED), res[str(p.relative_to(SHARED))]["rc"], file=sys.stderr)
    runs = json.loads((CORPUS / "runs.json").read_text())
    with tempfile.TemporaryDirectory() as tmp:
        for name in runs:
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            res[f"corpus/{name}"] = _diagnose(Path(tmp) / name, env, tmp)
            print(name, res[f"corpus/{name}"]["rc"], file=sys.stderr)
    Path(out).write_text(json.dumps(res, indent=1) + "\n")


def compare(before: str, after: str) -> int:
    b, a = json.loads(Path(before).read_text()), json.loads(Path(after).read_text())
    changed = [k for k in sorted(set(b) | set(a)) if b.get(k) != a.get(k)]
    for k in changed:
        x, y = b.get(k) or {}, a.get(k) or {}
        what = [f for f in ("rc", "stdout", "stderr") if x.get(f) != y.get(f)]
        print(f"{k}: differs in {', '.join(what) or 'presence'}")
    print(f"inputs whose output changed: {len(changed)} of {len(set(b) | set(a))} "
          f"({sum(1 for r in a.values() if r['rc'] == 0)} diagnosed with exit 0 after)")
    return 1 if changed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "record":
        record(sys.argv[2], sys.argv[3])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
