"""``oomdoctor fit``'s search against the doubling search, on simulated jobs whose edge is known: how many trials
each takes, for starts and guess errors a user meets, and the bound (``report/loop.py`` ``EXTRA_TRIALS``).

A simulated job runs every micro-batch up to its edge E and runs out of memory above it; both searches run from
the same start S in [1, --high], the doubling search (``FitSearch`` with no guess: what ``fit --no-record`` runs)
and the guided one (the replay's guess g = E x (1 + error)). Edges E from 20 to --max-edge, every --every-th;
starts S = 1, E/8, E/2, 0.9E. Pure Python, deterministic: no GPU.

    python benchmarks/fit_search_bound.py                      # the table in docs/verify.md
    python benchmarks/fit_search_bound.py --extra 2,3,4        # the trade of EXTRA_TRIALS
    python benchmarks/fit_search_bound.py --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import oomdoctor.report.loop as loop
from oomdoctor.report.loop import FitSearch

STARTS = (("1", lambda e: 1), ("E/8", lambda e: max(1, e // 8)), ("E/2", lambda e: max(1, e // 2)),
          ("0.9E", lambda e: max(1, int(e * 0.9))))
ERRORS = (0.0, -0.01, -0.02, -0.05, -0.10, -0.72, 0.01, 0.05)


def trials(edge: int, start: int, guess: int | None, high: int) -> int:
    s = FitSearch(1, high, start, guess, "replayed" if guess is not None else "none")
    while (mb := s.propose()) is not None:
        s.record(mb, mb <= edge)
    if s.largest_ran != min(edge, high):
        sys.exit(f"wrong answer: edge {edge} start {start} guess {guess}: {s.largest_ran}")
    return len(s.tried)


def measure(extra: int, high: int, max_edge: int, every: int) -> dict:
    loop.EXTRA_TRIALS = extra
    rows = {}
    for name, start_of in STARTS:
        for err in ERRORS:
            diffs, guided, doubling = [], [], []
            for edge in range(20, max_edge + 1, every):
                s = start_of(edge)
                d = trials(edge, s, None, high)
                g = trials(edge, s, max(1, round(edge * (1 + err))), high)
                diffs.append(g - d)
                guided.append(g)
                doubling.append(d)
            rows[f"{name} {err:+.0%}"] = {"mean_guided": round(statistics.mean(guided), 2),
                                          "mean_doubling": round(statistics.mean(doubling), 2),
                                          "mean_diff": round(statistics.mean(diffs), 2), "max_diff": max(diffs),
                                          "share_above": round(sum(x > 0 for x in diffs) / len(diffs), 3)}
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--extra", default=str(loop.EXTRA_TRIALS), help="EXTRA_TRIALS values, comma-separated")
    ap.add_argument("--high", type=int, default=4096)
    ap.add_argument("--max-edge", type=int, default=2500)
    ap.add_argument("--every", type=int, default=9)
    ap.add_argument("--json")
    a = ap.parse_args()
    out = {int(x): measure(int(x), a.high, a.max_edge, a.every) for x in a.extra.split(",")}
    print("| start | guess error | " + " | ".join(f"EXTRA_TRIALS={x}: guided - doubling, mean (max)" for x in out)
          + " | doubling, mean trials |")
    print("|---|---|" + "---|" * len(out) + "---|")
    first = next(iter(out.values()))
    for key in first:
        start, err = key.split(" ")
        cells = " | ".join(f"{out[x][key]['mean_diff']:+.1f} ({out[x][key]['max_diff']:+d})" for x in out)
        print(f"| {start} | {err} | {cells} | {first[key]['mean_doubling']:.1f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"high": a.high, "edges": [20, a.max_edge, a.every], "rows": out}, f, indent=1)


if __name__ == "__main__":
    main()
