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


def sweep_rows(job: str, run: str) -> list[dict]:
    """The job's sweep records (``<job>-sweep.jsonl`` and ``-sweep-extra.jsonl``; the new kinds' sweeps, of their
    ``small`` size only, are the rows of ``new-kinds-small-sweep.jsonl`` with the job's kind). Empty when none."""
    rows = []
    for name in (f"{job}-sweep.jsonl", f"{job}-sweep-extra.jsonl"):
        p = CORPUS / name
        if p.exists():
            rows += [json.loads(ln) for ln in p.read_text().splitlines()]
    if job.startswith("new-kinds-") and run.endswith("-small"):
        kind = job.removeprefix("new-kinds-")
        rows += [r for r in (json.loads(ln) for ln in (CORPUS / "new-kinds-small-sweep.jsonl").read_text().splitlines())
                 if r.get("kind") == kind]
    for r in rows:  # a run whose rank 0 was stopped before writing its truth: the batch is in the run's name
        if "batch" not in r:
            r["batch"] = int(re.search(r"-b(\d+)$", r["run"]).group(1))
    return rows


def sweep(job: str, run: str = "") -> tuple[int, int] | None:
    """(largest micro-batch that ran below the first that ran out, first that ran out), or None."""
    rows = sweep_rows(job, run)
    bad = [r["batch"] for r in rows if r["exit_code"] != 0]
    if not rows or not bad:
        return None
    first = min(bad)
    return max(r["batch"] for r in rows if r["exit_code"] == 0 and r["batch"] < first), first


# Runs whose settings differ from their job's sweep: the sweep says nothing of their answer.
NOT_THE_SWEPT_SETTING = {
    "trainer-ddp-gpt2-checkpointing-b88": "gradient checkpointing on; the sweep ran without it",
    "trainer-ddp-gpt2-eval-accumulate": "an evaluation that keeps every batch's logits runs out at any training "
                                        "micro-batch; the sweep trained without evaluation",
}


def answer(rep) -> tuple[int | None, str]:
    """The job's answer to what fits and its kind: ``replayed`` (the tightest rank's replayed largest micro-batch),
    ``lower bound`` / ``estimate`` (rank 0's estimated one, by its ``bound``), ``none``."""
    fits = [r.fits.largest_micro_batch for r in rep.ranks if r.fits and r.fits.largest_micro_batch]
    if fits:
        return min(fits), "replayed"
    est = [(r.fits.estimated_largest_micro_batch, r.fits.bound) for r in rep.ranks
           if r.fits and getattr(r.fits, "estimated_largest_micro_batch", None)]
    if est:
        got, bound = min(est)
        return got, "lower bound" if bound == "lower" else "estimate"
    return None, "none"


def within_target(got: int | None, largest: int | None, first_oom: int | None, step: int | None) -> str:
    """Issue 35's target: never above the largest micro-batch that ran, at most 5% below it, or one sweep step
    below where the sweep is coarser (``step``: docs/corpus/sweeps.json). ``yes``, ``no (above)``,
    ``no (N% low)``, ``unproven`` (between the largest that ran and the first OOM, not run), ``no answer``,
    ``-`` (no sweep of this job and setting)."""
    if largest is None:
        return "-"
    if got is None:
        return "no answer"
    if got > largest:
        return "unproven (not run)" if first_oom is not None and got < first_oom else "no (above)"
    low = min(0.95 * largest, largest - (step or 0))
    return "yes" if got >= low - 1e-9 else f"no ({100 * (largest - got) / largest:.1f}% low)"


def held_named(bds, held: dict, recorded: bool) -> dict:
    """How the weight copies and buffers a job holds besides its trained model (its truth's ``held``: bytes by what,
    each of kind ``weight_copy`` or ``buffers``; scenarios/_truth.py) are named at the last ``optimizer_start``:
    the breakdown's weight_copy, buffers, unknown (by why) and outputs bytes, who made the copies and buffers, and
    ``named``: with the sidecar, weight_copy and buffers each within 5% (+4 KiB) of the job's; from the trace alone,
    never more weight copies than the job holds copies (a buffer is never a weight copy: issue 54) and at least 95%
    of what it holds a copy, a buffer or unknown with a rule's reason (frozen_or_buffer, copy_or_buffer). The build before issue 54 has no buffers line nor reasons: what it
    read as weight copies counts, and nothing else. ``gradients``, ``outputs`` and another model's ``parameters``
    are never right: those are judged by the model-state errors beside this (within 5%)."""
    want = {k: sum(v["bytes"] for v in held.values() if v["kind"] == k) for k in ("weight_copy", "buffers")}
    at = [b for b in bds if b.at == "optimizer_start"]
    if not at:
        return {"held": want, "named": None}
    b = at[-1]
    c = b.categories
    got = {k: c.get(k, 0) for k in ("weight_copy", "buffers", "outputs", "unknown")}
    reasons = {k: b.unknown_why.get(k, 0) for k in ("frozen_or_buffer", "copy_or_buffer")}
    both = want["weight_copy"] + want["buffers"]
    if recorded:
        named = all(abs(got[k] - want[k]) <= 0.05 * want[k] + 4096 for k in ("weight_copy", "buffers"))
    else:
        named = (got["weight_copy"] <= 1.05 * want["weight_copy"] + 4096  # a buffer is never a weight copy
                 and got["weight_copy"] + got["buffers"] + sum(reasons.values()) >= 0.95 * both)
    return {"held": want, "got": got, "unknown_why": dict(b.unknown_why), "reasons": sum(reasons.values()),
            "weight_copy_by": dict(getattr(b, "weight_copy_by", {}) or {}),
            "buffers_by": dict(getattr(b, "buffers_by", {}) or {}), "named": named}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--half", action="append", choices=("in-sample", "tuning", "held-out"),
                   help="only the runs of this half (docs/corpus/README.md; repeatable; default: all)")
    p.add_argument("--only", action="append",
                   help="only the runs whose name starts with this prefix (e.g. new-kinds-; repeatable)")
    a = p.parse_args()
    runs = json.loads((CORPUS / "runs.json").read_text())
    if a.half:
        runs = {k: v for k, v in runs.items() if v.get("half", "in-sample") in a.half}
    if a.only:
        runs = {k: v for k, v in runs.items() if k.startswith(tuple(a.only))}
    steps = json.loads((CORPUS / "sweeps.json").read_text())
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
            rows = sweep_rows(spec["job"], name)
            gpu = next((r["gpu_total_memory_bytes"] for r in rows if r.get("gpu_total_memory_bytes")), None)
            row = {"run": name, "half": spec.get("half", "in-sample"), "expected": spec["verdict"],
                   "batch": truth.get("batch"), "rank": rank}  # a job without a micro-batch (a GNN) has none
            for mode in ("trace", "recorded"):
                traces = load_ranks([run], skipped=[])
                for t in traces:  # a plain recording does not say the GPU's size: given as --gpu-memory would be
                    if gpu and not isinstance(t.meta.get("gpu_total_memory_bytes"), int):
                        t.meta["gpu_total_memory_bytes"], t.meta["gpu_total_memory_given"] = gpu, True
                if mode == "trace":
                    for t in traces:  # what an older recorder's sidecar lacks: every storage it notes
                        t.meta.pop("tensors", None)
                        t.meta.pop("modules", None)
                elif not traces[0].meta.get("tensors"):
                    continue
                t0 = time.perf_counter()
                rep = build_report(traces, micro_batch=truth.get("batch"))
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
                held = truth.get("held")
                if held is not None:  # issue 54's jobs: what each holds besides its trained model, named how
                    row[f"{mode}_held"] = held_named(bds, held, recorded=mode == "recorded")
                if mode == "trace":
                    row["verdict"] = rep.verdict.kind
                    # the job's answer: its tightest rank's (a pipeline's stages differ)
                    fits = [r.fits.largest_micro_batch for r in rep.ranks if r.fits and r.fits.largest_micro_batch]
                    row["largest_micro_batch"] = min(fits) if fits else None
                    row["answer"], row["answer_kind"] = answer(rep)
                    row["estimated_largest_micro_batch"] = getattr(r0.fits, "estimated_largest_micro_batch", None)
                    row["expandable_largest_micro_batch"] = r0.fits.expandable_largest_micro_batch if r0.fits else None
            sw = None if name in NOT_THE_SWEPT_SETTING or name.endswith("-expandable") else sweep(spec["job"], name)
            row["measured_largest"], row["measured_first_oom"] = sw if sw else (None, None)
            row["sweep_step"] = steps.get(spec["job"]) if sw else None
            row["within_target"] = within_target(row["answer"], row["measured_largest"], row["measured_first_oom"],
                                                 row["sweep_step"])
            if name in NOT_THE_SWEPT_SETTING or name.endswith("-expandable"):
                row["within_target_note"] = NOT_THE_SWEPT_SETTING.get(name, "expandable_segments:True; the sweep ran "
                                                                                "with the default allocator")
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
    print("\nWhat fits against the sweeps (issue 35's target: never above the largest that ran, at most 5% or one "
          "sweep step below it)\n")
    print("| run | half | answer | kind | largest ran | first OOM | within target |")
    print("|---|---|---|---|---|---|---|")
    swept = [r for r in out if r["measured_largest"] is not None]
    for r in swept:
        print(f"| {r['run']} | {r['half']} | {'-' if r['answer'] is None else r['answer']} | {r['answer_kind']} | "
              f"{r['measured_largest']} | {r['measured_first_oom']} | {r['within_target']} |")
    for half in ("in-sample", "tuning", "held-out"):
        h = [r for r in swept if r["half"] == half]
        print(f"{half}: {sum(r['within_target'] == 'yes' for r in h)} of {len(h)} swept runs within target, "
              f"{sum(r['within_target'] == 'no (above)' for r in h)} above what ran")
    held = [r for r in out if "trace_held" in r]
    if held:
        print("\nWhat the job holds besides its trained model (issue 54; its truth's held), at the last optimizer "
              "step's start: weight copies / buffers / unknown with a rule's reason / outputs, MiB (the job's: "
              "copies, buffers)\n")
        print("| run | half | job's copies | job's buffers | trace: copy / buffers / reason / outputs | named "
              "| sidecar: copy / buffers / reason / outputs | named |")
        print("|---|---|---|---|---|---|---|---|")

        def mib(x):
            return f"{x / 2**20:,.1f}"

        def cell(h):
            if h is None or h.get("named") is None:
                return "- | -"
            g = h["got"]
            return (f"{mib(g['weight_copy'])} / {mib(g['buffers'])} / {mib(h['reasons'])} / {mib(g['outputs'])} | "
                    f"{'yes' if h['named'] else 'no'}")

        for r in held:
            w = r["trace_held"]["held"]
            print(f"| {r['run']} | {r['half']} | {mib(w['weight_copy'])} | {mib(w['buffers'])} | "
                  f"{cell(r.get('trace_held'))} | {cell(r.get('recorded_held'))} |")
        print("\nTheir model state against the job's own count, from the trace alone / with the sidecar\n")
        print("| run | half | params | grads | optimizer |")
        print("|---|---|---|---|---|")
        for r in held:
            print(f"| {r['run']} | {r['half']} | " + " | ".join(
                f"{pct(r.get(f'trace_{c}_error'))} / {pct(r.get(f'recorded_{c}_error'))}"
                for c in ("parameters", "gradients", "optimizer_state")) + " |")
        for r in held:
            for mode in ("trace", "recorded"):
                h = r.get(f"{mode}_held") or {}
                if h.get("weight_copy_by") or h.get("buffers_by"):
                    print(f"{r['run']} ({mode}): copies by {h['weight_copy_by']}; buffers by {h['buffers_by']}")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
