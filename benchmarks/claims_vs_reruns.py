"""The calibration of diagnose's claims (issue 49, item 3): every allocator setting the verdict tries on a run that
ran out of memory, against the same job rerun on the GPU with that setting, and every setting replayed on a healthy
recording against a recording of the same job made with it.

    python benchmarks/claims_vs_reruns.py [--corpus DIR] [--half tuning ...] [--only PREFIX ...] [--json OUT.json]

``--corpus``: the corpus unpacked (``docs/corpus/*.tar.xz`` extracted into DIR), else each archive is unpacked into a
temporary directory. Runs on any source tree (``PYTHONPATH=SRC``): the code before issue 49 (``report/predict.py``'s
claims carried one margin and no ``continuation``) and after it read the same way (below).

**Claims.** Per OOM run and per setting it was rerun with (``docs/corpus/reruns.jsonl``, the ``*-expandable``
recordings of ``expandable-and-eval-runs.jsonl``, and the reruns of the device scripts, ``docs/corpus/round14-*.jsonl``),
the prediction ``diagnose`` makes (:class:`oomdoctor.report.predict.Predictor` with the inputs the pipeline passes it)
on every rank it can replay; the job's claim is its worst rank's (runs out, then at the edge, then the least spare
room). Also the shared ``fragmentation-oom`` snapshot (its ``expandable-end`` run is the rerun) and the H100
allocator traces (a healthy recording replayed under each other setting it was recorded with).

**What a claim says** of the job under its setting: ``runs out`` (the replay of the recorded events runs out, or the
rest of the step, replayed, does), ``at the edge`` (a hedge: the spare room at the recorded steps' peak is inside the
margin), ``completes`` (it gets through the recorded steps; before issue 49 a claim reaching only the recorded
events said nothing of the job: ``nothing`` here, counted as a hedge).

**Measured per claim**: ``covered``: the rerun's outcome is the claim's, or the rerun's peak reserved
(``max_memory_reserved`` of rank 0) lies within the margin of the claim's peak; ``width``: margin / capacity. The
summary gives coverage, hedges and widths, by half.
"""

from __future__ import annotations

import argparse
import json
import tarfile
import tempfile
from pathlib import Path

from oomdoctor.analysis.device import analyze
from oomdoctor.report.pipeline import build_report
from oomdoctor.report.predict import Predictor
from oomdoctor.simulate.replay import SimulationError
from oomdoctor.trace import load, load_ranks

try:  # after issue 49: the inputs report/pipeline.py passes every predictor
    from oomdoctor.report.margin import margin_inputs
except ImportError:  # before: the pipeline passed none
    def margin_inputs(a):
        return {}

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "docs" / "corpus"
SHARED = Path("/work/shared/snapshots")


def reruns() -> dict[tuple[str, str], dict]:
    """(run, PYTORCH_ALLOC_CONF) -> the rerun's row (``exit_code``, ``max_memory_reserved``)."""
    out = {}
    for ln in (CORPUS / "reruns.jsonl").read_text().splitlines():
        r = json.loads(ln)
        out[(r["rerun_of"], r["alloc_conf"])] = r
    for ln in (CORPUS / "expandable-and-eval-runs.jsonl").read_text().splitlines():
        r = json.loads(ln)
        if r["run"].endswith("-expandable"):
            out[(r["run"][: -len("-expandable")], r["alloc_conf"])] = r
    for f in sorted(CORPUS.glob("round14-*.jsonl")):
        for ln in f.read_text().splitlines():
            r = json.loads(ln)
            if r.get("rerun_of") and r.get("alloc_conf") is not None:
                out[(r["rerun_of"], r["alloc_conf"])] = r
    return out


def says(p: dict) -> str:
    """What a prediction says of the job under its setting (module doc)."""
    if p.get("oom") is not None or p["reach"] == "step-ran-out":
        return "runs out"
    if p.get("at_edge"):
        return "at the edge"
    if "continuation" not in p and p["reach"] == "recorded":
        return "nothing"  # before issue 49: only the recorded events, nothing said of the job
    return "completes"


def claim_peak(p: dict) -> int:
    """The claim's peak reserved: the recorded events' (after issue 49, what ``simulate`` prints); before, the
    higher of that and the extended step's, as its spare room was computed."""
    if "continuation" in p:
        return int(p["peak_reserved_bytes"])
    return max(int(p["peak_reserved_bytes"]), int(p.get("extended_peak_reserved_bytes") or 0))


ORDER = {"runs out": 0, "at the edge": 1, "nothing": 2, "completes": 3}


def job_claim(preds: list[dict]) -> dict:
    """The job's claim: its worst rank's (runs out, at the edge, then the least spare room); the peak and margin
    compared with the rerun (rank 0's counters) are rank 0's where rank 0 was replayed."""
    worst = min(preds, key=lambda p: (ORDER[says(p)], p.get("spare_bytes", 1 << 62)))
    r0 = next((p for p in preds if p["rank"] == 0), worst)
    cont = worst.get("continuation") or {}
    return {"says": says(worst), "reach": worst["reach"], "rank": worst["rank"], "peak_reserved_bytes": claim_peak(r0),
            "margin_bytes": int(r0["margin_bytes"]), "capacity_bytes": r0.get("capacity_bytes"),
            "spare_bytes": worst.get("spare_bytes"), "max_width": max((p["margin_bytes"] / p["capacity_bytes"]
                                                                       for p in preds if p.get("capacity_bytes")),
                                                                      default=None),
            "continuation": {k: cont.get(k) for k in ("outcome", "margin_bytes", "spare_bytes", "at_edge",
                                                      "heaviest_step_peak_allocated_bytes")} if cont else None}


def judged(c: dict, rerun: dict) -> dict:
    # a job that catches its OOM and exits 0 still ran out (its truth names the OOM: the GNN's capped runs)
    real = "completes" if rerun["exit_code"] == 0 and not rerun.get("oom") else "runs out"
    peak = rerun.get("max_memory_reserved")
    inside = (peak is not None and real == "completes" and c["says"] != "runs out"
              and abs(int(peak) - c["peak_reserved_bytes"]) <= c["margin_bytes"])
    c.update(rerun=real, rerun_peak_reserved_bytes=peak, outcome_confirmed=c["says"] == real, peak_inside=inside,
             covered=c["says"] == real or inside, hedge=c["says"] in ("at the edge", "nothing"),
             width=None if not c["capacity_bytes"] else c["margin_bytes"] / c["capacity_bytes"])
    return c


def predictions(analyses, config: str) -> list[dict]:
    out = []
    for a in analyses:
        if not a.num_events or not a.trace.has_history:
            continue
        try:
            p = Predictor(a, **margin_inputs(a))
        except SimulationError:
            continue
        if not p.reproduces:
            continue
        out.append(p.run({"config": config}))
    return out


def corpus_rows(corpus: Path | None, halves: list[str] | None, only: list[str] | None = None) -> list[dict]:
    runs = json.loads((CORPUS / "runs.json").read_text())
    done = reruns()
    rows = []
    tmp = None if corpus else tempfile.TemporaryDirectory()
    base = corpus or Path(tmp.name)
    for name, spec in runs.items():
        half = spec.get("half", "in-sample")
        if (halves and half not in halves) or (only and not name.startswith(tuple(only))):
            continue
        confs = sorted({conf for run, conf in done if run == name})
        if not confs:
            continue
        if tmp is not None:
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(base, filter="data")
        traces = load_ranks([base / name], skipped=[])
        analyses = [analyze(t) for t in traces]
        if not any(a.oom_events.size for a in analyses):
            continue
        verdict = build_report(traces).verdict
        for conf in confs:
            preds = predictions(analyses, conf)
            row = {"run": name, "half": half, "setting": conf, "expected": spec["verdict"],
                   "verdict": verdict.kind if verdict else None,
                   "verdict_setting": (verdict.evidence.get("defragmented_config") if verdict else None)}
            if not preds:
                rows.append({**row, "says": "no claim (not replayed)", "covered": None})
                continue
            rows.append(judged({**row, **job_claim(preds)}, done[(name, conf)]))
    if tmp is not None:
        tmp.cleanup()
    return rows


def shared_rows() -> list[dict]:
    """The shared fragmentation-oom snapshot (its expandable run is the rerun) and the H100 allocator traces."""
    rows = []
    frag = SHARED / "fragmentation-oom"
    if frag.exists():
        stats = {s["tag"]: s for s in map(json.loads, (frag / "stats.jsonl").read_text().splitlines())}
        t = load(frag / "default-oom.pickle")
        a = analyze(t)
        conf = "expandable_segments:True"
        exp = stats["frag-expandable"]
        row = {"run": "shared:fragmentation-oom/default-oom", "half": "shared", "setting": conf,
               "expected": "fragmentation", "verdict": build_report([t]).verdict.kind}
        rows.append(judged({**row, **job_claim(predictions([a], conf))},
                           {"exit_code": 0 if exp["oom"] is None else 1, "max_memory_reserved": exp["max_reserved"]}))
    traces = CORPUS / "allocator-traces.tar.xz"
    with tempfile.TemporaryDirectory() as tmp, tarfile.open(traces) as tar:
        tar.extractall(tmp, filter="data")
        base = Path(tmp) / "allocator-traces"
        for rec in ("cap-default", "nocap-default"):
            t = load(base / rec / "rank0.pickle")
            a = analyze(t)
            for other in sorted(base.iterdir()):
                if other.name == rec or other.name.split("-")[0] != rec.split("-")[0] or not (other / "truth.json").exists():
                    continue
                truth = json.loads((other / "truth.json").read_text())
                preds = predictions([a], truth["alloc_conf"])
                if not preds:
                    continue
                row = {"run": f"allocator-traces/{rec}", "half": "shared", "setting": truth["alloc_conf"],
                       "expected": "healthy", "verdict": None}
                rows.append(judged({**row, **job_claim(preds)},
                                   {"exit_code": 1 if truth["oom"] else 0,
                                    "max_memory_reserved": truth["memory_stats"]["reserved_bytes.all.peak"]}))
    return rows


def summary(rows: list[dict]) -> dict:
    out = {}
    for half in ["all", *sorted({r["half"] for r in rows})]:
        got = [r for r in rows if r.get("covered") is not None and (half == "all" or r["half"] == half)]
        if not got:
            continue
        widths = [r["width"] for r in got if r["width"] is not None]
        cont = [r["continuation"] for r in got if r.get("continuation")]
        out[half] = {"claims": len(got), "covered": sum(r["covered"] for r in got),
                     "coverage": round(sum(r["covered"] for r in got) / len(got), 4),
                     "outcome_confirmed": sum(r["outcome_confirmed"] for r in got),
                     "hedges": sum(r["hedge"] for r in got),
                     "hedge_share": round(sum(r["hedge"] for r in got) / len(got), 4),
                     "refuted": sum(1 for r in got if not r["covered"]),
                     "width_max": round(max(widths), 5) if widths else None,
                     "width_median": round(sorted(widths)[len(widths) // 2], 5) if widths else None,
                     "over_10_percent": sum(1 for w in widths if w > 0.10),
                     "continuation_at_edge": sum(1 for c in cont if c.get("at_edge")),
                     "continuation_condition_only": sum(1 for c in cont if c.get("margin_bytes") is None)}
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--corpus", type=Path)
    p.add_argument("--json")
    p.add_argument("--half", action="append", choices=("in-sample", "tuning", "held-out"))
    p.add_argument("--only", action="append", help="only the runs whose name starts with this prefix (repeatable)")
    a = p.parse_args()
    rows = corpus_rows(a.corpus, a.half, a.only) + ([] if a.half or a.only else shared_rows())
    gib = 1 << 30
    print("| run | half | setting | verdict (expected) | says | rerun | claim peak / rerun peak (GiB) | margin (GiB) "
          "| width | covered |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        width = "-" if r.get("width") is None else f"{100 * r['width']:.2f}%"
        if r.get("covered") is None:
            print(f"| {r['run']} | {r['half']} | {r['setting']} | {r['verdict']} ({r['expected']}) | {r['says']} "
                  "| | | | | - |")
            continue
        peak = r["rerun_peak_reserved_bytes"]
        print(f"| {r['run']} | {r['half']} | {r['setting']} | {r['verdict']} ({r['expected']}) | {r['says']} "
              f"| {r['rerun']} | {r['peak_reserved_bytes'] / gib:.2f} / "
              f"{'-' if peak is None else f'{peak / gib:.2f}'} | {r['margin_bytes'] / gib:.3f} "
              f"| {width} | {'yes' if r['covered'] else 'NO'} |")
    s = summary(rows)
    print()
    for half, x in s.items():
        print(f"{half}: {x['covered']} of {x['claims']} covered ({100 * x['coverage']:.1f}%; {x['outcome_confirmed']} "
              f"outcomes confirmed), {x['hedges']} hedges ({100 * x['hedge_share']:.1f}%), widest margin "
              f"{100 * (x['width_max'] or 0):.2f}% of its capacity ({x['over_10_percent']} above 10%); continuation: "
              f"{x['continuation_at_edge']} at the edge, {x['continuation_condition_only']} a condition only")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "summary": s}, indent=1) + "\n")


if __name__ == "__main__":
    main()
