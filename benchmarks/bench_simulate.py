"""Replay speed of the allocator model, per config, and the wall time of ``--search``.

For each config the trace is replayed ``--repeat`` times (configs interleaved, so machine noise hits all
alike) and the median is kept. Two rates are given: the replay loop alone (``ReplayResult.elapsed_s``:
what the model costs per event) and the whole ``replay()`` call (adds rounding every request for the
config and installing the state at the trace's start). ``--search`` runs the full grid once with one
worker and once with every CPU, side by side. Usage::

    python benchmarks/bench_simulate.py [SNAPSHOT] [--repeat N] [--json OUT]

Default snapshot: ``../shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz`` (271,109 events).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[1].parent / "shared/snapshots/large/fsdp2-gpt2-60steps-rank0.pickle.xz"
CONFIGS = [("", "recorded"), ("", "immediate"), ("expandable_segments:True", "recorded"),
           ("max_split_size_mb:512", "recorded"), ("roundup_power2_divisions:4", "recorded"),
           ("garbage_collection_threshold:0.8", "recorded")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("snapshot", nargs="?", default=str(DEFAULT))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()

    from oomdoctor import load
    from oomdoctor.simulate.capacity import Capacity
    from oomdoctor.simulate.config import parse_config
    from oomdoctor.simulate.replay import prepare, replay
    from oomdoctor.simulate.whatif import simulate

    trace = load(args.snapshot)
    t0 = time.perf_counter()
    prepared = prepare(trace)
    prepare_s = time.perf_counter() - t0
    n = prepared.device.num_events
    # a fraction cap well above the peak, so that the GC config is active but no run OOMs
    cap = Capacity(limit_bytes=64 << 30, kind="fraction", source="benchmark: 64 GiB fraction cap")
    loops: dict[str, list[float]] = {}
    walls: dict[str, list[float]] = {}
    peaks: dict[str, int] = {}
    for _ in range(args.repeat):
        for text, mode in CONFIGS:
            key = f"{text or '(defaults)'} / {mode}"
            t0 = time.perf_counter()
            r = replay(prepared, parse_config(text), deferred_frees=mode, capacity=cap)
            walls.setdefault(key, []).append(time.perf_counter() - t0)
            loops.setdefault(key, []).append(r.elapsed_s)
            peaks[key] = r.peak_reserved_bytes
            assert r.oom is None and r.events_replayed == n
    rows = []
    for key in loops:
        loop, wall = statistics.median(loops[key]), statistics.median(walls[key])
        rows.append({"config": key, "events": n, "loop_s": round(loop, 4), "replay_s": round(wall, 4),
                     "events_per_s_loop": round(n / loop), "events_per_s_replay": round(n / wall),
                     "peak_reserved_bytes": peaks[key]})

    search = {}
    for workers in (1, os.cpu_count() or 1):
        t0 = time.perf_counter()
        sim = simulate(trace, search=True, workers=workers, prepared=prepared)
        search[workers] = {"wall_s": round(time.perf_counter() - t0, 3), "replays": len(sim.results),
                           "recommended": str(sim.recommendation.result.config) if sim.recommendation else None}

    out = {"snapshot": args.snapshot, "events": n, "prepare_s": round(prepare_s, 3), "repeat": args.repeat,
           "python": platform.python_version(), "machine": platform.machine(), "cpus": os.cpu_count(),
           "configs": rows, "search": search}
    print(f"{n} events; prepare {prepare_s:.3f} s (once per trace)")
    print(f"{'config':50} {'loop ev/s':>11} {'replay ev/s':>12} {'peak reserved':>15}")
    for r in rows:
        print(f"{r['config']:50} {r['events_per_s_loop']:>11,} {r['events_per_s_replay']:>12,} "
              f"{r['peak_reserved_bytes']:>15,}")
    for w, s in search.items():
        print(f"--search with {w} worker(s): {s['wall_s']} s for {s['replays']} replays, recommends {s['recommended']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    sys.exit(main())
