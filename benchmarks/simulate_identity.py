"""The allocator replay's outputs on real snapshots, as one JSON digest, to show that a change to the replay
(e.g. a faster event loop) leaves them byte-identical. Usage::

    PYTHONPATH=OLD/src python benchmarks/simulate_identity.py DIR_OR_FILE... --out before.json
    PYTHONPATH=NEW/src python benchmarks/simulate_identity.py DIR_OR_FILE... --out after.json
    python benchmarks/simulate_identity.py --compare before.json after.json   # exit 1 on any difference

``--replay-only`` loads each file as ``oomdoctor simulate`` does (``load_ranks(..., replay_only=True)``, trees
after issue 38 round 10), to show that the lean columns replay the same as the full ones.

Every ``*.pickle`` / ``*.pickle.xz`` under the paths given (each rank of a multi-rank file) is prepared once and
replayed under :data:`CONFIGS`, each with ``recorded`` and ``immediate`` deferred frees, under no cap and under a
fraction cap of 0.8 x the recorded peak reserved (so the fallbacks, GC and OOMs run too). Kept per replay: peak
reserved / allocated, end reserved, the OOM, events replayed, alloc retries, the validation, and the simulated
segment entries ``(action, address, size)`` in full (their SHA-256 and count). Also per trace: the capacity
``oomdoctor simulate`` infers and settles by replay (``capacity``), which reads the stacks of segment entries.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from dataclasses import asdict
from pathlib import Path

CONFIGS = ["", "expandable_segments:True", "max_split_size_mb:128", "max_split_size_mb:512",
           "roundup_power2_divisions:4", "garbage_collection_threshold:0.8",
           "max_split_size_mb:512,garbage_collection_threshold:0.6"]


def files(paths: list[str]) -> list[Path]:
    out: list[Path] = []
    for p in map(Path, paths):
        out += sorted(x for x in p.rglob("*") if x.name.endswith((".pickle", ".pickle.xz"))) if p.is_dir() else [p]
    return out


def digest(paths: list[str], replay_only: bool = False) -> dict:
    from oomdoctor import load_ranks
    from oomdoctor.simulate.capacity import Capacity, infer_capacity
    from oomdoctor.simulate.config import parse_config
    from oomdoctor.simulate.replay import IMMEDIATE, RECORDED, SimulationError, prepare, replay
    from oomdoctor.simulate.whatif import settle_capacity

    options = {"replay_only": True} if replay_only else {}

    out: dict[str, dict] = {}
    for f in files(paths):
        try:
            traces = load_ranks([str(f)], **options)
        except Exception as e:  # noqa: BLE001 - a file the reader refuses is recorded as such
            out[str(f)] = {"error": type(e).__name__}
            continue
        for tr in traces:
            if not tr.has_history:
                continue
            prepared = prepare(tr)
            peak = max(prepared.reserved_start, max((s for *_, s in prepared.rec_seg), default=0))
            caps = [Capacity(limit_bytes=None, kind="none", source="unlimited"),
                    Capacity(limit_bytes=int(peak * 0.8) or 1, kind="fraction",
                             source="identity check: 0.8 x a recorded size")]
            rows = {"capacity": asdict(settle_capacity(prepared, infer_capacity(tr, prepared.device)))}
            for text in CONFIGS:
                for mode in (RECORDED, IMMEDIATE):
                    for cap in caps:
                        try:
                            r = replay(prepared, parse_config(text), deferred_frees=mode, capacity=cap, validate=True)
                        except SimulationError as e:
                            rows[f"{text}|{mode}|{cap.limit_bytes}"] = {"error": str(e)}
                            continue
                        seg = repr(r.model.segment_events).encode()
                        rows[f"{text}|{mode}|{cap.limit_bytes}"] = {
                            "peak_reserved": r.peak_reserved_bytes, "peak_allocated": r.peak_allocated_bytes,
                            "end_reserved": r.end_reserved_bytes, "oom": None if r.oom is None else asdict(r.oom),
                            "events_replayed": r.events_replayed, "retries": r.num_alloc_retries,
                            "initial": r.initial_state, "warnings": r.warnings,
                            "segment_events": r.segment_events, "segment_sha256": hashlib.sha256(seg).hexdigest(),
                            "validation": None if r.validation is None else asdict(r.validation),
                            "end_model": [r.model.reserved, r.model.allocated, r.model.active, r.model.requested],
                        }
            out[f"{f}#{tr.rank}"] = rows
        print(f, file=sys.stderr)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*")
    ap.add_argument("--out")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"))
    ap.add_argument("--replay-only", action="store_true", help="load as oomdoctor simulate does (replay_only=True)")
    a = ap.parse_args()
    if a.compare:
        x, y = (json.loads(Path(p).read_text()) for p in a.compare)
        diff = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
        replays = sum(len(v) for v in x.values())
        print(f"{len(x)} traces, {replays} replays compared; {len(diff)} traces differ")
        for k in diff[:20]:
            print("  differs:", k)
        sys.exit(1 if diff else 0)
    d = digest(a.paths, a.replay_only)
    text = json.dumps(d, indent=1, sort_keys=True)
    if a.out:
        Path(a.out).write_text(text + "\n")
    else:
        print(text)


if __name__ == "__main__":
    main()
