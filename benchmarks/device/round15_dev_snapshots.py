"""Memory snapshots of the public corpus's development-half scripts on the GPU, at the K-th optimizer step (issue 50):
what preflight's traces are compared with event by event (``benchmarks/preflight_compare.py``).

    python benchmarks/device/round15_dev_snapshots.py OUT --corpus .corpus --data DATA [--half dev|heldout|all]
        [--parallel 3] [--timeout 170]

``--only NAME ...`` runs the entries named; else ``--half`` (default ``dev``) picks the one-GPU entries of that half of ``split.json``. The held-out half was reported
before and after at 7b2fcb7 (``docs/preflight.md``); snapshotting it (``--half heldout`` / ``all``) makes its scripts
development scripts from then on, and the docs say so.

It is ``benchmarks/preflight_corpus/truth.py`` (same entries, working directories, environment, K) with
``benchmarks/device/snapshot_hook`` first on ``PYTHONPATH`` instead of the truth hook: each process records the
allocator's history and dumps ``OUT/snapshots/NAME-rank0.pickle`` at step K, then the truth hook writes its line
(``OUT/truths.jsonl``) and ends the process.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(HERE / "benchmarks" / "preflight_corpus"))
import corpus  # noqa: E402
import truth  # noqa: E402

HOOK = HERE / "benchmarks" / "device" / "snapshot_hook"


def main(argv: list[str]) -> int:
    out = Path(argv[0])
    half = "dev"
    if "--half" in argv:
        i = argv.index("--half")
        half, argv = argv[i + 1], argv[:i] + argv[i + 2:]
    os.environ["OOMSNAP_OUT"] = str(out.resolve() / "snapshots")
    truth.HOOK = HOOK
    if "--only" in argv:  # the entries named
        return truth.main([*argv, "--nproc", "1"])
    sp = corpus.split()
    names = [e["name"] for e in corpus.entries(nproc=1) if half == "all" or sp[e["name"]] == half]
    return truth.main([*argv, "--nproc", "1", "--only", *names])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main(sys.argv[1:]))
