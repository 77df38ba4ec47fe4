"""Load + diagnose of a large snapshot against plain ``pickle.load`` of the same file, side by side.

Both variants read the same file from disk (decompressing it the same way when it is compressed);
runs alternate so machine noise hits both alike; each variant also runs once in a fresh subprocess to
measure its peak RSS. Usage::

    python benchmarks/bench_diagnose.py [SNAPSHOT] [--repeat N] [--json OUT]

Default snapshot: ``../shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz`` (271,109 events).
"""

from __future__ import annotations

import argparse
import gzip
import json
import lzma
import os
import pickle
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"


def plain_pickle_load(path: str) -> object:
    """What a user's script does: open (decompress) and ``pickle.load``."""
    with open(path, "rb") as f:
        head = f.read(6)
    opener = lzma.open if head.startswith(b"\xfd7zXZ") else gzip.open if head.startswith(b"\x1f\x8b") else open
    with opener(path, "rb") as f:
        return pickle.load(f)


def oomdoctor_diagnose(path: str) -> object:
    from oomdoctor import diagnose

    return diagnose([path])


def _time(fn, path: str) -> float:
    t0 = time.perf_counter()
    fn(path)
    return time.perf_counter() - t0


def _rss_child(which: str, path: str) -> int:
    code = (
        "import resource, sys; sys.path.insert(0, %r); import bench_diagnose as b; "
        "getattr(b, %r)(%r); print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    ) % (str(Path(__file__).parent), which, path)
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return int(out.strip().splitlines()[-1]) * 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    path = args.snapshot
    # Peak RSS first, while this process is still small: Linux keeps a forked child's high-water mark
    # across exec, so children forked from a big parent would all report the parent's size.
    rss = {which: _rss_child(which, path) for which in ("plain_pickle_load", "oomdoctor_diagnose")}
    oomdoctor_diagnose(path)  # warm imports and the page cache
    plain_pickle_load(path)
    base, ours = [], []
    for _ in range(args.repeat):
        base.append(_time(plain_pickle_load, path))
        ours.append(_time(oomdoctor_diagnose, path))
    result = {
        "snapshot": os.path.basename(path),
        "bytes_on_disk": os.path.getsize(path),
        "repeat": args.repeat,
        "pickle_load_s": statistics.median(base),
        "diagnose_s": statistics.median(ours),
        "ratio": statistics.median(ours) / statistics.median(base),
        "pickle_load_runs_s": [round(x, 3) for x in base],
        "diagnose_runs_s": [round(x, 3) for x in ours],
        "pickle_load_peak_rss_bytes": rss["plain_pickle_load"],
        "diagnose_peak_rss_bytes": rss["oomdoctor_diagnose"],
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
