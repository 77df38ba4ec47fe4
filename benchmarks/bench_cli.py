"""The CLI as a user runs it, end to end (a fresh process each time, imports included), side by side with
``python -c "pickle.load(...)"`` of the same file, in one run. Usage::

    python benchmarks/bench_cli.py [SNAPSHOT] [--repeat N] [--scale K] [--json OUT]

Default snapshot: ``../shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz`` (271,109 events),
decompressed once to a temporary file that every command reads. Each command runs ``--repeat`` times,
interleaved with the others so machine noise hits all alike; the best run of each is reported (the
issue's "best of"), with the median beside it, and the peak RSS of every run's process (``wait4``).

- start-up: ``oomdoctor --help``; and ``python -X importtime -m oomdoctor --help``'s import total;
- ``oomdoctor diagnose FILE`` against ``pickle.load``;
- ``oomdoctor simulate FILE`` (one config, the self-replay), and ``--search`` with the default workers
  and with ``-j 1``: events/s per configuration, load included (events x replays / wall seconds);
- ``--scale K``: also a snapshot of K copies of the trace (distinct entries, times shifted; what the
  analyses conclude about it does not matter here), for how peak RSS / file size grows with the file;
  ``--scale-to BYTES`` picks K for a file of at least that size (from the sizes of 1 and 2 copies): ``--scale-to 2e9`` is the 2 GB case (about
  21 million events, generated in the temporary directory and removed after, never committed).
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import pickle
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"


def run(argv: list[str]) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {proc.returncode}")
    return wall, usage.ru_maxrss * 1024


def oomdoctor() -> list[str]:
    exe = shutil.which("oomdoctor")
    return [exe] if exe else [sys.executable, "-m", "oomdoctor"]


def import_total_s() -> float:
    """``python -X importtime -m oomdoctor --help``: the sum of top-level cumulative import times."""
    err = subprocess.run([sys.executable, "-X", "importtime", "-m", "oomdoctor", "--help"], capture_output=True,
                         text=True, check=True).stderr
    total = 0
    for line in err.splitlines():
        m = re.match(r"import time:\s+\d+ \|\s+(\d+) \| (\S.*)$", line)
        if m and not m.group(2).startswith(" "):
            total += int(m.group(1))
    return total / 1e6


def scaled(src: str, k: int, out: str) -> int:
    """Write a snapshot of ``k`` copies of ``src``'s trace; returns its event count."""
    with open(src, "rb") as f:
        snap = pickle.load(f)
    dev = max(range(len(snap["device_traces"])), key=lambda d: len(snap["device_traces"][d]))
    trace = snap["device_traces"][dev]
    span = trace[-1]["time_us"] - trace[0]["time_us"] + 1
    copies = []
    for i in range(k):
        lists: dict[int, list] = {}  # each copy has its own frames lists, shared where the original's are
        for e in trace:
            fl = e.get("frames")
            if fl is not None:
                fl = lists.setdefault(id(fl), list(fl))
            copies.append(dict(e, time_us=e["time_us"] + i * span, frames=fl))
    snap["device_traces"][dev] = copies
    with open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)
    return len(copies)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--scale", type=int, default=0, help="also measure a snapshot of K copies of the trace")
    ap.add_argument("--scale-to", type=float, default=0, help="also measure a snapshot of at least this many bytes")
    ap.add_argument("--json")
    ap.add_argument("--make-scaled", nargs=3, metavar=("SRC", "K", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.make_scaled:
        print(scaled(a.make_scaled[0], int(a.make_scaled[1]), a.make_scaled[2]))
        return
    tmp = tempfile.mkdtemp(prefix="oomdoctor-bench-")
    plain = os.path.join(tmp, "rank0.pickle")
    with open(a.snapshot, "rb") as f:
        head = f.read(6)
    opener = lzma.open if head.startswith(b"\xfd7zXZ") else open
    with opener(a.snapshot, "rb") as src, open(plain, "wb") as dst:
        shutil.copyfileobj(src, dst)
    # everything that unpickles runs in a child: Linux keeps a forked child's RSS high-water mark across
    # exec, so a big parent would inflate every child's peak RSS
    events = int(subprocess.run([sys.executable, "-c", f"import pickle; print(max(len(t) for t in pickle.load(open("
                                 f"{plain!r}, 'rb'))['device_traces']))"], capture_output=True, text=True,
                                check=True).stdout)
    cli = oomdoctor()
    load = [sys.executable, "-c", f"import pickle; pickle.load(open({plain!r}, 'rb'))"]
    commands = {
        "pickle_load": load,
        "help": cli + ["--help"],
        "diagnose": cli + ["diagnose", plain],
        "simulate": cli + ["simulate", plain],
        "simulate_search": cli + ["simulate", plain, "--search"],
        "simulate_search_j1": cli + ["simulate", plain, "--search", "-j", "1"],
    }
    search_out = subprocess.run(commands["simulate_search"] + ["-o", "/dev/stdout"], capture_output=True, text=True,
                                check=True).stdout
    replays = int(re.search(r"(\d+) replays in", search_out).group(1))  # the recommendation's "N replays in S s"
    runs: dict[str, list[tuple[float, int]]] = {k: [] for k in commands}
    for _ in range(a.repeat):
        for name, argv in commands.items():
            runs[name].append(run(argv))
    best = {k: min(w for w, _ in v) for k, v in runs.items()}
    result = {
        "snapshot": os.path.basename(a.snapshot), "bytes": os.path.getsize(plain), "events": events,
        "repeat": a.repeat, "best_s": {k: round(v, 3) for k, v in best.items()},
        "median_s": {k: round(statistics.median(w for w, _ in v), 3) for k, v in runs.items()},
        "peak_rss_bytes": {k: max(r for _, r in v) for k, v in runs.items()},
        "import_total_s_for_help": round(import_total_s(), 3),
        "diagnose_over_pickle_load": round(best["diagnose"] / best["pickle_load"], 2),
        "simulate_over_pickle_load": round(best["simulate"] / best["pickle_load"], 2),
        "search_replays": replays,
        "events_per_s_per_config": {
            "simulate": round(events / best["simulate"]),
            "simulate_search": round(events * replays / best["simulate_search"]),
            "simulate_search_j1": round(events * replays / best["simulate_search_j1"]),
        },
        "diagnose_rss_over_file": round(max(r for _, r in runs["diagnose"]) / os.path.getsize(plain), 2),
        "python": platform.python_version(), "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
    }
    if a.scale_to:  # a copy adds less than the file's size (frames are pickled once): measure what 1 and 2 copies take
        sizes = []
        for k in (1, 2):
            probe = os.path.join(tmp, f"probe{k}.pickle")
            subprocess.run([sys.executable, __file__, "--make-scaled", plain, str(k), probe], check=True,
                           capture_output=True)
            sizes.append(os.path.getsize(probe))
            os.remove(probe)
        a.scale = max(a.scale, 1 + -(-(int(a.scale_to) - sizes[0]) // (sizes[1] - sizes[0])))
    if a.scale > 1:
        big = os.path.join(tmp, "scaled-rank0.pickle")
        n = int(subprocess.run([sys.executable, __file__, "--make-scaled", plain, str(a.scale), big],
                               capture_output=True, text=True, check=True).stdout)
        wall, rss = run(cli + ["diagnose", big])
        lw, lrss = run([sys.executable, "-c", f"import pickle; pickle.load(open({big!r}, 'rb'))"])
        result["scaled"] = {"copies": a.scale, "events": n, "bytes": os.path.getsize(big), "diagnose_s": round(wall, 2),
                            "diagnose_peak_rss_bytes": rss, "pickle_load_s": round(lw, 2),
                            "pickle_load_peak_rss_bytes": lrss,
                            "diagnose_rss_over_file": round(rss / os.path.getsize(big), 2)}
    shutil.rmtree(tmp)
    print(json.dumps(result, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
