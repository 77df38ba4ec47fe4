"""Compare a snapshot recorded on the GPU with preflight's traced snapshot of the same job, event by event (issue 50,
item 4: the T5 miss).

    python benchmarks/preflight_compare.py GPU.pickle TRACED.pickle [--steps 2] [--json OUT.json]

Both are read as ``torch.cuda.memory._dump_snapshot`` pickles (the GPU one from ``oomdoctor run``, the traced one from
``oomdoctor preflight -o``). Allocations are cut at the end of optimizer step ``--steps`` (the GPU recording goes on to
the script's end; preflight stops there), each keyed by its size and its allocation site (the innermost frame in
transformers, torch.nn or the script; no frame: the autograd engine's thread). Printed:

- peak requested bytes (live allocations' sizes) of each, and their ratio;
- the two sequences of sizes aligned (``difflib.SequenceMatcher``): the share matched, and the first places they
  part, with the sites on both sides;
- per site: bytes allocated and count on the GPU and in the trace, the largest differences first.
"""

from __future__ import annotations

import argparse
import collections
import difflib
import json
import pickle
import sys
from pathlib import Path

SITES = ("transformers/", "torch/nn/", "peft/", "timm/", "preflight_scripts/", "accelerate/")


def _events(path: str) -> list[dict]:
    snap = pickle.loads(Path(path).read_bytes())
    traces = [t for t in snap.get("device_traces", []) if t]
    return max(traces, key=len) if traces else []


def _site(frames: list[dict]) -> str:
    for f in frames or []:
        fn = f.get("filename", "")
        at = min((i for i in (fn.find(s) for s in SITES) if i >= 0), default=-1)
        if at >= 0:  # from the package's own directory on: the same site wherever the package is installed
            return f"{fn[at:]}:{f.get('line')}:{f.get('name')}"
    return "(no Python frame: backward)" if not frames else f"{frames[0].get('filename', '?').split('/')[-1]}:" \
                                                               f"{frames[0].get('line')}"


def _cut(events: list[dict], steps: int) -> list[dict]:
    """Events up to the end of the ``steps``-th optimizer step: the last allocation made by an optimizer's step
    (a frame in torch/optim/) of that step, found as the ``steps``-th run of optimizer allocations."""
    runs, inside, end = 0, False, len(events)
    for i, e in enumerate(events):
        opt = any("torch/optim/" in f.get("filename", "") for f in e.get("frames") or [])
        if opt and not inside:
            inside = True
        elif inside and not opt and e["action"] == "alloc":
            inside = False
            runs += 1
            if runs == steps:
                end = i
                break
    return events[:end]


def _peak(events: list[dict]) -> int:
    live: dict[int, int] = {}
    cur = peak = 0
    for e in events:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            cur += e["size"]
            peak = max(peak, cur)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])
    return peak


def compare(gpu: str, traced: str, steps: int) -> dict:
    g, t = _cut(_events(gpu), steps), _cut(_events(traced), steps)
    ga = [e for e in g if e["action"] == "alloc"]
    ta = [e for e in t if e["action"] == "alloc"]
    sm = difflib.SequenceMatcher(None, [e["size"] for e in ga], [e["size"] for e in ta], autojunk=False)
    parts = []
    for op, i1, i2, j1, j2 in sm.get_opcodes():
        if op != "equal" and len(parts) < 12:
            parts.append({"op": op, "gpu": [(ga[i]["size"], _site(ga[i]["frames"])) for i in range(i1, min(i2, i1 + 4))],
                          "traced": [(ta[j]["size"], _site(ta[j]["frames"])) for j in range(j1, min(j2, j1 + 4))],
                          "gpu_at": i1, "traced_at": j1, "gpu_n": i2 - i1, "traced_n": j2 - j1})
    sites: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0, 0])
    for e in ga:
        s = sites[_site(e["frames"])]
        s[0] += e["size"]
        s[1] += 1
    for e in ta:
        s = sites[_site(e["frames"])]
        s[2] += e["size"]
        s[3] += 1
    by = sorted(sites.items(), key=lambda kv: -abs(kv[1][0] - kv[1][2]))
    pg, pt = _peak(g), _peak(t)
    return {"gpu_peak_requested_bytes": pg, "traced_peak_requested_bytes": pt,
            "traced_over_gpu": round(pt / pg, 4) if pg else None,
            "gpu_allocs": len(ga), "traced_allocs": len(ta), "matched_share": round(sm.ratio(), 4),
            "first_differences": parts,
            "sites": [{"site": k, "gpu_bytes": v[0], "gpu_n": v[1], "traced_bytes": v[2], "traced_n": v[3]}
                      for k, v in by[:40]]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("gpu")
    ap.add_argument("traced")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    r = compare(a.gpu, a.traced, a.steps)
    if a.json:
        Path(a.json).write_text(json.dumps(r, indent=1))
    print(f"peak requested: GPU {r['gpu_peak_requested_bytes']:,} B, traced {r['traced_peak_requested_bytes']:,} B "
          f"(traced/GPU {r['traced_over_gpu']}); allocations {r['gpu_allocs']:,} / {r['traced_allocs']:,}, "
          f"sequence matched {r['matched_share']:.1%}")
    for p in r["first_differences"][:6]:
        print(f"  {p['op']} at GPU #{p['gpu_at']} (+{p['gpu_n']}) / traced #{p['traced_at']} (+{p['traced_n']}):")
        print(f"    GPU    {p['gpu']}")
        print(f"    traced {p['traced']}")
    print("sites, largest differences (bytes allocated over the steps, GPU - traced):")
    for s in r["sites"][:15]:
        print(f"  {s['gpu_bytes'] - s['traced_bytes']:>+16,}  GPU {s['gpu_n']:>5} / traced {s['traced_n']:>5}  "
              f"{s['site']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
