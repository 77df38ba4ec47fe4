"""``oomdoctor simulate FILE`` (one configuration, the self-replay) end to end, side by side with
``pickle.load`` of the same file, in one run: issue 38's metric, events / (simulate wall - pickle.load wall).
Usage::

    python benchmarks/bench_simulate_e2e.py [SNAPSHOT] [--repeat N] [--src LABEL=DIR ...] [--json OUT]

Default snapshot: ``../shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz`` (271,109 events),
decompressed once to a temporary file. Every repetition runs ``pickle.load`` and ``oomdoctor simulate``
under each ``--src``, in an order that rotates from one repetition to the next (a fixed order favoured the last
tree on a machine that had just started: round 11 in docs/benchmarks.md), (a ``src`` folder put first on ``PYTHONPATH``, e.g. ``before=/tmp/base/src``; default: the
one this file sits next to), each a fresh process, so machine noise hits all alike; the median of each is
kept. Also given: the CPU seconds (user + system, ``wait4``) of each process, steadier than wall time on a
shared machine, and the same rate computed from them.
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT.parent / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"


def run(argv: list[str], env: dict[str, str] | None = None) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one process; exits if it fails."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} exited {os.waitstatus_to_exitcode(status)}")
    return wall, usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--src", action="append", default=[], metavar="LABEL=DIR",
                    help="a src folder to run oomdoctor from (repeatable; default: this checkout's)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    srcs = dict(s.split("=", 1) for s in a.src) or {"this": str(ROOT / "src")}

    tmp = tempfile.mkdtemp(prefix="oomdoctor-simbench-")
    try:
        plain = os.path.join(tmp, "rank0.pickle")
        with open(a.snapshot, "rb") as f:
            xz = f.read(6).startswith(b"\xfd7zXZ")
        with (lzma.open if xz else open)(a.snapshot, "rb") as src, open(plain, "wb") as dst:
            shutil.copyfileobj(src, dst)
        events = int(subprocess.run([sys.executable, "-c", f"import pickle; print(max(len(t) for t in pickle.load("
                                     f"open({plain!r}, 'rb'))['device_traces']))"], capture_output=True, text=True,
                                    check=True).stdout)
        load = [sys.executable, "-c", f"import pickle; pickle.load(open({plain!r}, 'rb'))"]
        sim = [sys.executable, "-m", "oomdoctor", "simulate", plain]
        # every tree with its bytecode compiled, into a cache of this run's own (PYTHONPYCACHEPREFIX: the trees are
        # not written to): a tree without .pyc files (PYTHONDONTWRITEBYTECODE, a fresh copy) would pay about 0.1 s
        # of compiling in every run and lose to one that has them
        base = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        base["PYTHONPYCACHEPREFIX"] = os.path.join(tmp, "pycache")
        for d in srcs.values():
            subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.abspath(d)], check=True, env=base,
                           stdout=subprocess.DEVNULL)
        envs = {label: {**base, "PYTHONPATH": os.path.abspath(d)} for label, d in srcs.items()}
        runs: dict[str, list[tuple[float, float]]] = {"pickle_load": [], **{f"simulate[{k}]": [] for k in srcs}}
        for label, env in envs.items():  # warm the page cache and the .pyc files
            run(sim, env)
        jobs = [("pickle_load", load, None)] + [(f"simulate[{label}]", sim, env) for label, env in envs.items()]
        for rep in range(a.repeat):  # the order rotates every repetition: no tree always runs first or last
            for key, argv, env in jobs[rep % len(jobs):] + jobs[:rep % len(jobs)]:
                runs[key].append(run(argv, env))
    finally:
        shutil.rmtree(tmp)
    wall = {k: statistics.median(w for w, _ in v) for k, v in runs.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in runs.items()}
    out = {"snapshot": os.path.basename(a.snapshot), "events": events, "repeat": a.repeat, "srcs": srcs,
           "median_wall_s": {k: round(v, 3) for k, v in wall.items()},
           "median_cpu_s": {k: round(v, 3) for k, v in cpu.items()},
           "all_wall_s": {k: [round(w, 3) for w, _ in v] for k, v in runs.items()},
           "events_per_s": {}, "events_per_s_cpu": {}, "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    for label in srcs:
        k = f"simulate[{label}]"
        out["events_per_s"][label] = round(events / (wall[k] - wall["pickle_load"]))
        out["events_per_s_cpu"][label] = round(events / (cpu[k] - cpu["pickle_load"]))
        # each repetition's own simulate against its own pickle.load, then the median (steadier on a noisy machine)
        out.setdefault("events_per_s_paired", {})[label] = round(statistics.median(
            events / (s[0] - p[0]) for s, p in zip(runs[k], runs["pickle_load"]) if s[0] > p[0]))
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
