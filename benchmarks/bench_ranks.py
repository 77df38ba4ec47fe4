"""Many ranks, as a user runs ``oomdoctor diagnose DIR`` (a fresh process each time), at 8, 64 and 512 ranks.

The ranks are built from one real rank file (default: the shared ``ddp-clean/rank0.pickle``, a DDP rank of 2.4 MB):
each rank gets one more segment and block allocated after the last event, of a size drawn per rank (0-0.4% of the
peak reserved: alike ranks, peaks within 1%); one odd rank (the middle one) gets 20% of the peak more. Each count is
run with the default ``--jobs`` (all cores) and with ``--jobs 1``, interleaved; recorded: wall seconds, the CLI
process's peak RSS (``wait4``; pool workers are separate processes, each holding one rank at a time), lines of
text at 80 columns, and the line that first names the odd rank. Usage::

    python benchmarks/bench_ranks.py [--ranks 8 64 512] [--base FILE] [--repeat N] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import oomdoctor  # noqa: E402

from oomdoctor.trace.reader import decode, read_file  # noqa: E402

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared/snapshots/ddp-clean/rank0.pickle"
MiB = 1 << 20


def make_rank(snap: dict, extra_bytes: int, addr: int) -> dict:
    """``snap`` with one more segment of ``extra_bytes`` (rounded up to 2 MiB), all of it one allocated block,
    recorded as a ``segment_alloc`` and an ``alloc`` after the last event."""
    size = max(2 * MiB, -(-extra_bytes // (2 * MiB)) * 2 * MiB)
    out = dict(snap)
    trace = list(snap["device_traces"][0])
    t = trace[-1]["time_us"] + 10 if trace else 0
    fr = trace[-1].get("frames", []) if trace else []
    base = {"stream": 0, "frames": fr, "compile_context": "N/A", "user_metadata": ""}
    trace += [{**base, "action": "segment_alloc", "addr": addr, "size": size, "time_us": t},
              {**base, "action": "alloc", "addr": addr, "size": size, "time_us": t + 1}]
    out["device_traces"] = [trace] + list(snap["device_traces"][1:])
    seg = {"device": 0, "address": addr, "total_size": size, "allocated_size": size, "active_size": size,
           "requested_size": size, "stream": 0, "segment_type": "large", "segment_pool_id": (0, 0),
           "is_expandable": False, "frames": fr,
           "blocks": [{"address": addr, "size": size, "requested_size": size, "state": "active_allocated",
                       "frames": fr}]}
    out["segments"] = list(snap["segments"]) + [seg]
    return out


def build(base: Path, ranks: int, out: Path, seed: int = 0) -> int:
    """Write ``ranks`` rank files into ``out``; returns the odd rank."""
    snap = decode(str(base), read_file(str(base)))
    reserved = sum(s["total_size"] for s in snap["segments"])
    top = max(s["address"] + s["total_size"] for s in snap["segments"])
    rng = random.Random(seed)
    odd = ranks // 2
    out.mkdir(parents=True, exist_ok=True)
    for r in range(ranks):
        extra = int(reserved * (0.20 if r == odd else rng.uniform(0.0, 0.004)))
        with open(out / f"rank{r}.pickle", "wb") as f:
            pickle.dump(make_rank(snap, extra, top + (1 << 30)), f, protocol=4)
    return odd


def run(argv: list[str], env: dict) -> tuple[float, int, str]:
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    out = proc.stdout.read().decode("utf-8")
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_maxrss * 1024, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 512])
    ap.add_argument("--base", type=Path, default=DEFAULT)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    env = {**os.environ, "COLUMNS": "80"}
    rows = []
    tmp = Path(tempfile.mkdtemp(prefix="bench_ranks_"))
    try:
        for n in args.ranks:
            d = tmp / f"r{n}"
            odd = build(args.base, n, d)
            size = sum(f.stat().st_size for f in d.iterdir())
            best: dict[str, tuple[float, int, str]] = {}
            for _ in range(args.repeat):
                for mode, extra in (("default", []), ("jobs1", ["--jobs", "1"])):
                    got = run(oomdoctor() + ["diagnose", str(d)] + extra, env)
                    if mode not in best or got[0] < best[mode][0]:
                        best[mode] = got
            text = best["default"][2]
            lines = text.splitlines()
            named = next((i + 1 for i, x in enumerate(lines) if f"{odd}" in x.split("odd")[-1]
                          and "odd" in x), None)
            row = {"ranks": n, "bytes": size, "odd_rank": odd, "cpus": os.cpu_count(),
                   "default_s": round(best["default"][0], 2), "jobs1_s": round(best["jobs1"][0], 2),
                   "speedup": round(best["jobs1"][0] / best["default"][0], 2),
                   "default_rss_bytes": best["default"][1], "jobs1_rss_bytes": best["jobs1"][1],
                   "lines": len(lines), "max_width": max(len(x) for x in lines),
                   "odd_rank_named_at_line": named, "same_text": best["default"][2] == best["jobs1"][2]}
            rows.append(row)
            print(json.dumps(row), flush=True)
            shutil.rmtree(d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps({"machine": platform.platform(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
