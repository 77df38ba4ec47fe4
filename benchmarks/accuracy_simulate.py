"""Accuracy of the allocator model on every shared snapshot, and of its what-if predictions against
real runs of the same workload under the other setting. Prints markdown tables; ``--json`` saves them.

    python benchmarks/accuracy_simulate.py [--shared ../shared] [--json OUT]

1. Self-replay: each snapshot replayed under its recorded settings (capacity inferred from the
   snapshot), compared event by event with the recording.
2. What-if vs measured: the prediction for a setting on one recording against the recording of the
   real run with that setting (``stats.jsonl`` and the snapshots themselves).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DEFAULT_SHARED = Path(__file__).resolve().parents[1].parent / "shared"
GiB = 1 << 30


def stats(shared: Path, folder: str, tag: str, rank: int) -> dict:
    for line in (shared / "snapshots" / folder / "stats.jsonl").read_text().splitlines():
        d = json.loads(line)
        if d["tag"] == tag and d["rank"] == rank:
            return d
    raise KeyError(tag)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shared", default=str(DEFAULT_SHARED))
    ap.add_argument("--json")
    args = ap.parse_args()
    shared = Path(args.shared)

    from oomdoctor import load
    from oomdoctor.analysis.lifetimes import lifetimes
    from oomdoctor.analysis.timeline import timeline
    from oomdoctor.simulate.capacity import Capacity, infer_capacity
    from oomdoctor.simulate.config import parse_config
    from oomdoctor.simulate.replay import IMMEDIATE, prepare, replay

    rows = []
    for path in sorted((shared / "snapshots").rglob("*.pickle*")):
        t = load(path)
        p = prepare(t)
        cap = infer_capacity(t, p.device)
        r = replay(p, capacity=cap)
        v = r.validation
        rows.append({"snapshot": str(path.relative_to(shared / "snapshots")), "events": p.device.num_events,
                     "start": r.initial_state, "segment_events": v.segment_events_recorded,
                     "simulated": v.segment_events_simulated, "differing": v.segment_events_differing,
                     "reserved_events_differing": v.reserved_events_differing,
                     "max_reserved_difference_bytes": v.max_reserved_difference_bytes,
                     "oom": None if r.oom is None else r.oom.event_index, "oom_matches": v.oom_matches,
                     "peak_reserved_bytes": r.peak_reserved_bytes})

    whatif = []
    frag = shared / "snapshots/fragmentation-oom"
    default = load(frag / "default-oom.pickle")
    exp_trace = load(frag / "expandable-end.pickle")
    exp = exp_trace.primary
    allocs = (exp.events["action"] == 0).nonzero()[0]
    n = int((default.primary.events["action"] == 0).sum())
    tl = timeline(exp, lifetimes(exp_trace, exp))
    target = int(tl.reserved[: int(allocs[n]) + 1].max())
    cap = Capacity(limit_bytes=41_519_093_862, kind="fraction", source="shared/snapshots/README.md")
    r = replay(prepare(default), parse_config("expandable_segments:True"), capacity=cap)
    whatif.append({"recording": "fragmentation-oom/default-oom", "what_if": "expandable_segments:True",
                   "measured_in": "expandable-end.pickle, peak reserved up to the same request",
                   "predicted_bytes": r.peak_reserved_bytes, "measured_bytes": target,
                   "predicted_oom": r.oom is not None, "measured_oom": False})
    tp = prepare(load(shared / "snapshots/tp-allreduce/legacy-rank0.pickle"))
    modern = stats(shared, "tp-allreduce", "tp-modern-b4096", 0)["max_reserved"]
    legacy_exp = stats(shared, "tp-allreduce", "tp-legacy-expandable-b4096", 0)["max_reserved"]
    r = replay(tp, deferred_frees=IMMEDIATE)
    whatif.append({"recording": "tp-allreduce/legacy-rank0", "what_if": "frees not deferred (immediate)",
                   "measured_in": "modern-rank0 (PyTorch 2.11 all_reduce), stats.jsonl", "predicted_bytes":
                   r.peak_reserved_bytes, "measured_bytes": modern, "predicted_oom": False, "measured_oom": False})
    r = replay(tp, parse_config("expandable_segments:True"))
    whatif.append({"recording": "tp-allreduce/legacy-rank0", "what_if": "expandable_segments:True",
                   "measured_in": "legacy-expandable-rank0, stats.jsonl", "predicted_bytes": r.peak_reserved_bytes,
                   "measured_bytes": legacy_exp, "predicted_oom": False, "measured_oom": False})

    print("| snapshot | events | start state | segment events (recorded / simulated / differing) | "
          "events with reserved differing (max bytes) | OOM (event, same as recorded) |")
    print("|---|---|---|---|---|---|")
    for x in rows:
        oom = "none" if x["oom"] is None else f"{x['oom']}"
        print(f"| {x['snapshot']} | {x['events']:,} | {x['start']} | {x['segment_events']} / {x['simulated']} / "
              f"{x['differing']} | {x['reserved_events_differing']} ({x['max_reserved_difference_bytes']}) | "
              f"{oom}, {'yes' if x['oom_matches'] else 'NO'} |")
    print()
    print("| recording | what if | measured in | predicted peak reserved | measured | error |")
    print("|---|---|---|---|---|---|")
    for w in whatif:
        err = (w["predicted_bytes"] - w["measured_bytes"]) / w["measured_bytes"]
        w["relative_error"] = round(err, 5)
        print(f"| {w['recording']} | {w['what_if']} | {w['measured_in']} | {w['predicted_bytes']:,} "
              f"({w['predicted_bytes'] / GiB:.3f} GiB) | {w['measured_bytes']:,} ({w['measured_bytes'] / GiB:.3f} GiB) "
              f"| {err:+.2%} |")
    own = own_recordings(whatif)
    if args.json:
        Path(args.json).write_text(json.dumps({"self_replay": rows, "what_if": whatif, "own_recordings": own},
                                              indent=2) + "\n")


def own_recordings(whatif: list) -> list:
    """Self-replay of docs/corpus/allocator-traces (GC, max_split_size, caps, CUDA graphs; H100, 2.11) through
    ``simulate_recorded`` (the CLI's path: capacity inferred, settled by replay), with the sidecar and from
    the snapshot alone; and the expandable-segments what-if against the real expandable runs."""
    import shutil
    import tarfile
    import tempfile

    from oomdoctor import load
    from oomdoctor.simulate.whatif import simulate_recorded

    archive = Path(__file__).resolve().parents[1] / "docs/corpus/allocator-traces.tar.xz"
    tmp = Path(tempfile.mkdtemp())
    with tarfile.open(archive) as tar:
        tar.extractall(tmp, filter="data")
    root = tmp / "allocator-traces"
    rows = []
    for run in sorted(p.name for p in root.iterdir()):
        truth = json.loads((root / run / "truth.json").read_text())
        bare = tmp / f"{run}-rank0.pickle"
        shutil.copy(root / run / "rank0.pickle", bare)
        for label, path in (("sidecar", root / run / "rank0.pickle"), ("snapshot alone", bare)):
            sim = simulate_recorded(load(path))
            v = sim.self_replay.validation
            c = sim.capacity
            rows.append({"run": run, "inputs": label, "alloc_conf": truth["alloc_conf"], "events": sim.num_events,
                         "cap_bytes": truth["cap_bytes"], "capacity": c.limit_bytes, "certainty": c.certainty,
                         "bounds": [c.lower_bytes, c.upper_bytes], "segment_events": v.segment_events_recorded,
                         "simulated": v.segment_events_simulated, "differing": v.segment_events_differing,
                         "reserved_events_differing": v.reserved_events_differing,
                         "peak_reserved_bytes": sim.self_replay.peak_reserved_bytes,
                         "measured_peak_reserved_bytes": truth["memory_stats"]["reserved_bytes.all.peak"],
                         "private_pools": [n for n in sim.notes if "private pool" in n]})
    for base, real in (("nocap-default", "nocap-expandable"), ("cap-default", "cap-expandable")):
        sim = simulate_recorded(load(root / base / "rank0.pickle"), configs=["expandable_segments:True"])
        measured = json.loads((root / real / "truth.json").read_text())["memory_stats"]["reserved_bytes.all.peak"]
        whatif.append({"recording": f"allocator-traces/{base}", "what_if": "expandable_segments:True",
                       "measured_in": f"allocator-traces/{real}, torch.cuda.memory_stats",
                       "predicted_bytes": sim.results[1].peak_reserved_bytes, "measured_bytes": measured,
                       "predicted_oom": sim.results[1].oom is not None, "measured_oom": False})
        w = whatif[-1]
        w["relative_error"] = round((w["predicted_bytes"] - measured) / measured, 5)
    shutil.rmtree(tmp)
    print()
    print("| run | PYTORCH_CUDA_ALLOC_CONF | inputs | events | cap (certainty) | segment events (recorded / simulated "
          "/ differing) | events with reserved differing | peak reserved (replayed = measured) |")
    print("|---|---|---|---|---|---|---|---|")
    for x in rows:
        cap = "none" if x["capacity"] is None else f"{x['capacity']:,} ({x['certainty']})"
        same = "yes" if x["peak_reserved_bytes"] == x["measured_peak_reserved_bytes"] else "NO"
        print(f"| {x['run']} | `{x['alloc_conf'] or '-'}` | {x['inputs']} | {x['events']:,} | {cap} | "
              f"{x['segment_events']} / {x['simulated']} / {x['differing']} | {x['reserved_events_differing']} | "
              f"{x['peak_reserved_bytes']:,} ({same}) |")
    print()
    for w in whatif[-2:]:
        print(f"| {w['recording']} | {w['what_if']} | {w['measured_in']} | {w['predicted_bytes']:,} | "
              f"{w['measured_bytes']:,} | {w['relative_error']:+.3%} |")
    return rows


if __name__ == "__main__":
    sys.exit(main())
