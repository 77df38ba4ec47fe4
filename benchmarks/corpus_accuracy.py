"""Diagnosis on the real-job corpus (docs/corpus/) against what each job measured itself.

For every run: the verdict against the expected one (docs/corpus/runs.json), the model-state bytes
(parameters, gradients when the optimizer step begins, optimizer state) against the job's own counts
from the trace alone and with the storages ``oomdoctor run`` recorded, what fits against the job's batch
sweep (largest micro-batch that ran, first that did not), and the time ``diagnose`` took in-process.

    python benchmarks/corpus_accuracy.py [--json docs/corpus_accuracy.json]

Prints a markdown table (docs/diagnose.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
import tempfile
import time
from pathlib import Path

from oomdoctor.report import build_report
from oomdoctor.trace import load_ranks

CORPUS = Path(__file__).resolve().parents[1] / "docs" / "corpus"


def sweep(job: str) -> tuple[int, int] | None:
    rows = []
    for name in (f"{job}-sweep.jsonl", f"{job}-sweep-extra.jsonl"):
        p = CORPUS / name
        if p.exists():
            rows += [json.loads(ln) for ln in p.read_text().splitlines()]
    for r in rows:  # a run whose rank 0 was stopped before writing its truth: the batch is in the run's name
        if "batch" not in r:
            r["batch"] = int(re.search(r"-b(\d+)$", r["run"]).group(1))
    bad = [r["batch"] for r in rows if r["exit_code"] != 0]
    if not rows or not bad:
        return None
    first = min(bad)
    return max(r["batch"] for r in rows if r["exit_code"] == 0 and r["batch"] < first), first


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--half", action="append", choices=("in-sample", "tuning", "held-out"),
                   help="only the runs of this half (docs/corpus/README.md; repeatable; default: all)")
    p.add_argument("--only", help="only the runs whose name starts with this prefix (e.g. new-kinds-)")
    a = p.parse_args()
    runs = json.loads((CORPUS / "runs.json").read_text())
    if a.half:
        runs = {k: v for k, v in runs.items() if v.get("half", "in-sample") in a.half}
    if a.only:
        runs = {k: v for k, v in runs.items() if k.startswith(a.only)}
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, spec in runs.items():
            with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
                tar.extractall(tmp, filter="data")
            run = Path(tmp) / name
            # rank 0's own counts; a pipeline run whose rank 0 was stopped by its launcher has only rank 1's
            rank, tpath = next((r, run / f) for r, f in ((0, "ground_truth.json"), (1, "ground_truth.rank1.json"))
                               if (run / f).exists())
            truth = json.loads(tpath.read_text())
            row = {"run": name, "half": spec.get("half", "in-sample"), "expected": spec["verdict"],
                   "batch": truth["batch"], "rank": rank}
            for mode in ("trace", "recorded"):
                traces = load_ranks([run], skipped=[])
                if mode == "trace":
                    for t in traces:
                        t.meta.pop("tensors", None)
                elif not traces[0].meta.get("tensors"):
                    continue
                t0 = time.perf_counter()
                rep = build_report(traces, micro_batch=truth["batch"])
                row[f"{mode}_s"] = round(time.perf_counter() - t0, 3)
                r0 = next((r for r in rep.ranks if r.rank == rank), rep.ranks[0])
                bds = r0.breakdowns
                got = {"parameters": max([b.categories["parameters"] for b in bds] or [0]),
                       "gradients": max([b.categories["gradients"] for b in bds
                                         if b.at in ("optimizer_start", "backward_end")] or [0]),
                       "optimizer_state": max([b.categories["optimizer_state"] for b in bds] or [0])}
                for c, key in (("parameters", "parameters_bytes"), ("gradients", "gradients_bytes"),
                               ("optimizer_state", "optimizer_state_bytes")):
                    row[f"{mode}_{c}_error"] = (round((got[c] - truth[key]) / truth[key], 4)
                                                if truth.get(key) and name != "lightning-ddp-gpt2-val-logits" else None)
                    row[f"{mode}_{c}_bytes"] = got[c]
                if mode == "trace":
                    row["verdict"] = rep.verdict.kind
                    # the job's answer: its tightest rank's (a pipeline's stages differ)
                    fits = [r.fits.largest_micro_batch for r in rep.ranks if r.fits and r.fits.largest_micro_batch]
                    row["largest_micro_batch"] = min(fits) if fits else None
                    row["estimated_largest_micro_batch"] = getattr(r0.fits, "estimated_largest_micro_batch", None)
                    row["expandable_largest_micro_batch"] = r0.fits.expandable_largest_micro_batch if r0.fits else None
            sw = sweep(spec["job"])
            row["measured_largest"], row["measured_first_oom"] = sw if sw else (None, None)
            out.append(row)
    print("| run | half | verdict (expected) | params | grads | optimizer | largest micro-batch (measured: largest, "
          "first OOM) |")
    print("|---|---|---|---|---|---|---|")

    def pct(x):
        return "-" if x is None else f"{100 * x:+.1f}%"

    for r in out:
        v = r["verdict"] + ("" if r["verdict"] == r["expected"] else f" (expected {r['expected']})")
        fit = "-" if r["largest_micro_batch"] is None else str(r["largest_micro_batch"])
        meas = "" if r["measured_largest"] is None else f" ({r['measured_largest']}, {r['measured_first_oom']})"
        print(f"| {r['run']} | {r['half']} | {v} | {pct(r['trace_parameters_error'])} | {pct(r['trace_gradients_error'])} | "
              f"{pct(r['trace_optimizer_state_error'])} | {fit}{meas} |")
    right = sum(r["verdict"] == r["expected"] for r in out)
    print(f"\nverdicts right: {right} of {len(out)}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
