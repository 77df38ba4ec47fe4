"""Mutation testing of the rule modules: reruns ``mutmut`` and checks that the tests kill at least 80%.

The modules and the tests are configured in ``pyproject.toml`` (``[tool.mutmut]``): ``analysis/accounting.py``,
``analysis/phases.py``, ``report/verdict.py``, ``report/fits.py`` and ``detectors/``, against ``tests/unit`` alone
(mutmut runs, for each mutant, only the tests that reached the mutated function, fastest first, and stops at the
first failure; the integration tests are left out so that a surviving mutant costs seconds, which makes the score a
lower bound for the whole suite). The real snapshots come from ``OOMDOCTOR_SHARED`` (default: ``../shared``);
without them the tests that need them skip and fewer mutants are killed.

Usage::

    pip install mutmut==3.8.1
    python benchmarks/mutation.py                # run, then write docs/mutation.json; exit 1 below 80% killed
    python benchmarks/mutation.py --report-only  # summarise the last run (mutants/ is kept, never committed)
    python benchmarks/mutation.py --results A.txt.xz B.txt.xz --retested 'PATTERN'
                                                 # summarise saved `mutmut results --all true` outputs (from
                                                 # another machine: docs/mutation_runs/), later files over
                                                 # earlier ones; --retested: functions changed and re-tested
                                                 # whole in a later file (their earlier numbering is stale)
    python benchmarks/mutation.py --sample 600   # a random sample, from each module in proportion to its
                                                 # mutants, at least 5 (hours -> minutes); the score is then an
                                                 # estimate, reported with its 95% interval
    python benchmarks/mutation.py --sample 300 --seed 13 --exclude docs/mutation_runs/run12-simulate-sample-names.txt.xz
                                                 # a sample held out from an earlier one that tests were
                                                 # written against (its names are never drawn)
    python benchmarks/mutation.py --names docs/mutation_runs/run13-simulate-heldout-names.txt
                                                 # exactly the mutants of a sample drawn before (the same
                                                 # sample before and after a change)

A mutant counts as killed when a test failed or timed out under it; ``survived`` and ``no tests`` count against
the score. The surviving mutants judged equivalent (no test could tell them apart) are listed, with the reason,
in ``docs/testing.md``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import lzma
import math
import os
import random
import re
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = 0.80
SAMPLE = ROOT / "mutants" / "sample.json"  # the names of the last sampled run
KILLED = {"killed", "timeout"}
NOT_RUN = {"skipped", "not checked"}
_LINE = re.compile(r"^\s+(?P<name>\S+): (?P<status>.+)$")


def module_of(mutant: str) -> str:
    """``oomdoctor.detectors.cache_flush.x_detect__mutmut_3`` -> ``oomdoctor.detectors.cache_flush``."""
    parts = mutant.split(".")
    return ".".join(p for p in parts[:-1])


def saved_results(paths: list[Path], retested: list[str]) -> list[tuple[str, str]]:
    """The tested mutants of saved ``mutmut results --all true`` outputs (plain or .xz), later files over
    earlier ones; the mutants of an earlier file matching a ``retested`` pattern (``fnmatch``) are dropped once
    a later file tested any mutant matching it."""
    merged: dict[str, str] = {}
    for path in paths:
        with (lzma.open(path, "rt") if path.suffix == ".xz" else open(path)) as f:
            text = f.read()
        rows = [(m.group("name"), m.group("status").strip()) for line in text.splitlines() if (m := _LINE.match(line))]
        tested = [(n, st) for n, st in rows if st not in NOT_RUN]
        for pat in retested:
            if any(fnmatch.fnmatch(n, pat) for n, _st in tested):
                merged = {n: st for n, st in merged.items() if not fnmatch.fnmatch(n, pat)}
        merged.update(tested)
    return sorted(merged.items())


def results() -> list[tuple[str, str]]:
    out = subprocess.run([sys.executable, "-m", "mutmut", "results", "--all", "true"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout
    rows = [(m.group("name"), m.group("status").strip()) for line in out.splitlines() if (m := _LINE.match(line))]
    if not rows:
        raise SystemExit("no mutmut results: run without --report-only first")
    return rows


def all_mutants() -> list[str]:
    """Every mutant mutmut generated (``mutants/**/*.meta``), in a stable order."""
    names = []
    for meta in sorted((ROOT / "mutants").rglob("*.py.meta")):
        names += sorted(json.loads(meta.read_text()).get("exit_code_by_key", {}))
    return names


def read_names(path: Path) -> list[str]:
    """The mutant names of a file written by an earlier sample (one a line; ``.xz`` read compressed)."""
    with (lzma.open(path, "rt") if path.suffix == ".xz" else open(path)) as f:
        return [line.strip() for line in f if line.strip()]


def sample(names: list[str], n: int, seed: int) -> list[str]:
    """``n`` mutants drawn at random, spread over the modules in proportion to their mutants (at least 5 from
    each module that has them)."""
    rng = random.Random(seed)
    by: dict[str, list[str]] = defaultdict(list)
    for name in names:
        by[module_of(name)].append(name)
    out = []
    for _m, ms in sorted(by.items()):
        k = min(len(ms), max(5, round(n * len(ms) / len(names))))
        out += rng.sample(ms, k)
    return sorted(out)


def summary(rows: list[tuple[str, str]]) -> dict:
    per: dict[str, Counter] = defaultdict(Counter)
    for name, status in rows:
        per[module_of(name)][status] += 1
    total: Counter = sum(per.values(), Counter())

    def score(c: Counter) -> float:
        tested = sum(v for k, v in c.items() if k not in NOT_RUN)
        return sum(c[k] for k in KILLED) / tested if tested else 0.0

    tested = sum(v for k, v in total.items() if k not in NOT_RUN)
    p = score(total)
    half = 1.96 * math.sqrt(p * (1 - p) / tested) if tested else 0.0  # normal approximation, for a sample
    return {
        "target": TARGET,
        "tested": tested,
        "score": round(p, 4),
        "score_95_interval": [round(max(0.0, p - half), 4), round(min(1.0, p + half), 4)],
        "counts": dict(total),
        "modules": {m: {"score": round(score(c), 4), **dict(c)} for m, c in sorted(per.items())},
        "survivors": sorted(n for n, s in rows if s not in KILLED | NOT_RUN),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--report-only", action="store_true", help="summarise the last run without running mutmut")
    ap.add_argument("--max-children", type=int, default=None, help="mutmut's parallel workers (default: CPUs)")
    ap.add_argument("--sample", type=int, default=0, help="run about this many mutants, drawn at random")
    ap.add_argument("--seed", type=int, default=0, help="the sample's seed")
    ap.add_argument("--names", type=Path, help="run exactly the mutants named in this file (one a line, plain or "
                    ".xz), a sample drawn before: the same sample before and after a change")
    ap.add_argument("--exclude", type=Path, action="append", default=[],
                    help="a file of mutant names (one a line, plain or .xz) never drawn: an earlier sample that "
                         "tests were written against, so that this one is held out")
    ap.add_argument("--results", type=Path, nargs="+", help="summarise these saved results instead of running")
    ap.add_argument("--retested", action="append", default=[], help="with --results: see saved_results")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "mutation.json")
    args = ap.parse_args()
    if args.results:
        s = summary(saved_results(args.results, args.retested))
        s["sources"] = [str(p.relative_to(ROOT)) if p.is_absolute() and ROOT in p.parents else str(p)
                        for p in args.results]
        args.out.write_text(json.dumps(s, indent=1) + "\n")
        lo, hi = s["score_95_interval"]
        print(f"total: {s['counts']}; killed {s['score']:.1%} of {s['tested']} tested; written to {args.out}")
        return 0 if s["score"] >= TARGET else 1
    if not args.report_only:
        env = dict(os.environ)
        env.setdefault("OOMDOCTOR_SHARED", str(ROOT.parent / "shared"))
        cmd = [sys.executable, "-m", "mutmut", "run"]
        if args.max_children:
            cmd += ["--max-children", str(args.max_children)]
        if args.sample or args.names:
            if not all_mutants():  # generate them (and the test statistics) first: nothing is tested yet
                subprocess.run(cmd + ["no-such-mutant"], cwd=ROOT, env=env, check=False)
            if args.names:
                chosen = read_names(args.names)
                if missing := sorted(set(chosen) - set(all_mutants())):
                    raise SystemExit(f"{args.names}: {len(missing)} names are no mutant of this tree, e.g. {missing[0]}")
            else:
                seen = {n for path in args.exclude for n in read_names(path)}
                chosen = sample([n for n in all_mutants() if n not in seen], args.sample, args.seed)
            SAMPLE.write_text(json.dumps(chosen))
            cmd += chosen
        else:
            SAMPLE.unlink(missing_ok=True)
        subprocess.run(cmd, cwd=ROOT, env=env, check=False)
    rows = results()
    if SAMPLE.exists():  # the score of the sample alone, whatever else an earlier run tested
        chosen_set = set(json.loads(SAMPLE.read_text()))
        rows = [(n, st) for n, st in rows if n in chosen_set]
    s = summary(rows)
    s["sampled_of"] = len(all_mutants()) if SAMPLE.exists() else None
    args.out.write_text(json.dumps(s, indent=1) + "\n")
    print(f"{'module':<52} {'killed':>7} {'survived':>9} {'score':>7}")
    for m, c in s["modules"].items():
        print(f"{m:<52} {c.get('killed', 0) + c.get('timeout', 0):>7} "
              f"{c.get('survived', 0) + c.get('no tests', 0):>9} {c['score']:>7.1%}")
    lo, hi = s["score_95_interval"]
    print(f"total: {s['counts']}; killed {s['score']:.1%} of {s['tested']} tested (95% interval {lo:.1%}-{hi:.1%}; "
          f"target {TARGET:.0%}); written to {args.out}")
    return 0 if s["score"] >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
