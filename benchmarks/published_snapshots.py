"""Diagnose snapshots other people recorded and published (plain ``_dump_snapshot``: one forward pass, one
step), without oomdoctor's sidecar, and summarise what ``diagnose`` says of each.

The files are not ours to redistribute, so they are not in the repository: docs/published_snapshots.md
names each (repository, commit, path, SHA-256) and this script re-checks a directory holding them.

    python benchmarks/published_snapshots.py DIR [--json docs/published_snapshots.json]

Per file: the verdict, what the trace holds (forward only, one optimizer step...), the steps found, the
findings above LOW, and the peak breakdown.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

from oomdoctor import load
from oomdoctor.report import build_report


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("--json")
    a = p.parse_args()
    rows = []
    for f in sorted(Path(a.dir).glob("*.pickle")):
        t0 = time.perf_counter()
        rep = build_report([load(f)])
        dt = time.perf_counter() - t0
        r = rep.ranks[0]
        bd = r.breakdown
        rows.append({
            "file": f.name, "sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "events": r.events,
            "verdict": rep.verdict.kind if rep.verdict else None, "trace": r.trace_kind, "steps": r.steps,
            "step_source": r.step_source, "torch": r.torch_version,
            "material_findings": [(x.id, x.severity, x.bytes) for x in rep.findings if x.severity != "low"],
            "low_findings": [x.id for x in rep.findings if x.severity == "low"],
            "peak_breakdown": bd.categories if bd else None, "diagnose_s": round(dt, 3)})
        print(f"{f.name[:60]:60s} {rows[-1]['verdict']:14s} {r.trace_kind[:32]:32s} "
              f"material: {rows[-1]['material_findings'] or '-'}")
    print(f"\n{len(rows)} snapshots; material findings on {sum(bool(r['material_findings']) for r in rows)}; "
          f"steps found on {sum(r['steps'] is not None for r in rows)} "
          f"({sorted({r['trace'] for r in rows})})")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
