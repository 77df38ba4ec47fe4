"""The planner (``oomdoctor plan estimate --framework hf``) against every run of the real-job corpus.

For every run in ``docs/corpus`` (the batch sweeps and the recorded archives): the configuration the job
ran (``docs/corpus/plan_jobs.json`` and the run's own record: batch, gradient checkpointing,
``expandable_segments``), the predicted peak allocated against the job's ``torch.cuda.max_memory_allocated``
(runs that finished), and the predicted fit against what happened (runs that ran out of memory must not
be predicted to fit). For the recorded archives that finished, the prediction's diagnose categories at the
peak against ``oomdoctor diagnose``'s breakdown of rank 0 at its peak allocated.

    python benchmarks/plan_corpus.py [--json docs/plan_corpus.json] [--no-categories]

Prints markdown tables (docs/plan.md quotes them).
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import statistics
import tarfile
import tempfile
from pathlib import Path
from typing import Any

from oomdoctor.plan.estimate import Estimate, estimate
from oomdoctor.plan.specs import Hardware, ParallelPlan, TrainingSpec, model_spec

CORPUS = Path(__file__).resolve().parents[1] / "docs" / "corpus"
H200 = 150_109_880_320  # torch.cuda total_memory of the corpus GPUs (ground_truth.json gpu_total_memory_bytes)
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries", "communication", "outputs",
              "kv_cache", "workspaces", "unknown")


@functools.cache
def jobs() -> dict[str, dict[str, Any]]:
    """``plan_jobs.json``, read once."""
    return {k: v for k, v in json.loads((CORPUS / "plan_jobs.json").read_text()).items() if not k.startswith("_")}


def job_of(name: str, runs: dict[str, Any]) -> str:
    """A run's job: runs.json's (a rerun ``NAME@SETTING`` is NAME's job), else the name without its batch
    suffix."""
    name = name.split("@")[0] if name.split("@")[0] in runs else name
    if name in runs:
        return runs[name]["job"] if name not in jobs() else name
    return re.sub(r"-b\d+.*$", "", name)


def rows() -> list[dict[str, Any]]:
    """Every run of a job ``plan_jobs.json`` describes, with what it measured: the sweeps and reruns, then
    the archives not already in a sweep. The corpus's other jobs are in :func:`not_planned`."""
    return [r for r in all_rows() if r["job"] in jobs()]


def not_planned() -> list[str]:
    """The corpus's jobs ``plan_jobs.json`` does not describe (DeepSpeed, ``generate()``, pipeline schedules,
    optimizers outside torch.optim, plain recordings, evaluation loops): they are in the corpus for
    ``diagnose``, and the planner's ``--framework hf`` terms are not checked on them."""
    return sorted({r["job"] for r in all_rows()} - set(jobs()))


def all_rows() -> list[dict[str, Any]]:
    """Every run with what it measured: the sweeps, then the archives not already in a sweep."""
    runs = json.loads((CORPUS / "runs.json").read_text())
    out: list[dict[str, Any]] = []
    for p in sorted(CORPUS.glob("*.jsonl")):
        for ln in p.read_text().splitlines():
            r = json.loads(ln)
            name = r.get("run") or f"{p.name.split('-sweep')[0]}-b{r['batch']}"
            job = p.name.split("-sweep")[0] if "-sweep" in p.name else job_of(name, runs)
            out.append({"run": name, "job": job, **{k: r.get(k) for k in (
                "batch", "exit_code", "max_memory_allocated", "max_memory_reserved", "alloc_conf",
                "gradient_checkpointing")}})
    seen = {r["run"] for r in out}
    for name, spec in runs.items():
        if name in seen:
            continue
        with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
            f = tar.extractfile(f"{name}/ground_truth.json")
            truth = json.loads(f.read()) if f else {}
        out.append({"run": name, "job": spec["job"] if name not in jobs() else name, "batch": truth.get("batch"),
                    "exit_code": 1 if truth.get("oom") else 0, "alloc_conf": truth.get("alloc_conf"),
                    "max_memory_allocated": truth.get("max_memory_allocated"),
                    "max_memory_reserved": truth.get("max_memory_reserved"),
                    "gradient_checkpointing": truth.get("gradient_checkpointing")})
    return out


def predict(row: dict[str, Any]) -> Estimate | str:
    """The estimate of one run, or why it is refused."""
    job = jobs().get(row["job"]) or jobs().get(row["run"])
    if job is None:
        return f"no configuration for job {row['job']!r} in plan_jobs.json"
    if "refused" in job:
        return job["refused"]
    m = model_spec(str(CORPUS / job["model"]))
    b, gpus = row["batch"], job["gpus"]
    train = TrainingSpec(seq_len=job["seq"], global_batch=b * gpus * job["grad_accum"], micro_batch=b)
    plan = ParallelPlan(dp=gpus, dp_sharding=job["sharding"], framework="hf", loop=job["loop"],
                        recompute="full" if row.get("gradient_checkpointing") else "none",
                        expandable_segments="expandable_segments:True" in (row.get("alloc_conf") or ""))
    return estimate(m, train, plan, Hardware("h200", H200, gpus))


def diagnose_categories(name: str, tmp: Path) -> dict[str, int]:
    """``oomdoctor diagnose``'s categories of rank 0 at its peak allocated."""
    from oomdoctor.report import build_report
    from oomdoctor.trace import load_ranks

    with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
        tar.extractall(tmp, filter="data")
    report = build_report(load_ranks([tmp / name], skipped=[]))
    b = next(b for b in report.ranks[0].breakdowns if b.at == "peak_allocated")
    return dict(b.categories)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json")
    p.add_argument("--no-categories", action="store_true")
    a = p.parse_args()
    out, errors = [], []
    archives = set(json.loads((CORPUS / "runs.json").read_text()))
    with tempfile.TemporaryDirectory() as tmp:
        for r in rows():
            e = predict(r)
            row: dict[str, Any] = {**r}
            if isinstance(e, str):
                row["refused"] = e
                out.append(row)
                continue
            s = e.stages[0]
            row.update(predicted_allocated=s.allocated_bytes, predicted_device=s.device_bytes, fits=e.fits,
                       loss_moment=s.loss_moment, predicted_categories=s.categories)
            if r["exit_code"] == 0 and r["max_memory_allocated"]:
                row["error"] = (s.allocated_bytes - r["max_memory_allocated"]) / r["max_memory_allocated"]
                errors.append(abs(row["error"]))
            row["safe"] = bool(r["exit_code"] == 0 or not e.fits)
            if not a.no_categories and r["run"] in archives and r["exit_code"] == 0:
                sub = Path(tmp) / r["run"]
                sub.mkdir()
                row["diagnose_categories"] = diagnose_categories(r["run"], sub)
            out.append(row)
    print("| run | batch | exit | measured max allocated | predicted | error | predicted fit | peak moment |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out:
        if "refused" in r:
            measured = f"{r['max_memory_allocated']:,}" if r["max_memory_allocated"] else "-"
            print(f"| {r['run']} | {r['batch']} | {r['exit_code']} | {measured} | refused | | | |")
            continue
        err = f"{r['error']:+.2%}" if "error" in r else "(OOM)"
        fit = "fits" if r["fits"] else "does not fit"
        print(f"| {r['run']} | {r['batch']} | {r['exit_code']} | {r['max_memory_allocated']:,} | "
              f"{r['predicted_allocated']:,} | {err} | {fit}{'' if r['safe'] else ' **UNSAFE**'} | {r['loss_moment']} |")
    n_ok = sum(1 for r in out if "error" in r)
    n_oom = sum(1 for r in out if "refused" not in r and r["exit_code"] != 0)
    unsafe = [r["run"] for r in out if "refused" not in r and not r["safe"]]
    refused = [r["run"] for r in out if "refused" in r]
    print(f"\n{n_ok} finished runs: median |error| {statistics.median(errors):.2%}, largest {max(errors):.2%}; "
          f"{n_oom} OOM runs, predicted to fit: {len(unsafe)} {unsafe}; refused: {len(refused)} {refused}")
    print(f"corpus jobs plan_jobs.json does not describe (not checked): {', '.join(not_planned())}")
    cats = [r for r in out if "diagnose_categories" in r]
    if cats:
        print("\n| run | category | diagnose (GB) | predicted (GB) | difference (GB) |")
        print("|---|---|---|---|---|")
        for r in cats:
            for c in CATEGORIES:
                d, pr = r["diagnose_categories"].get(c, 0), r["predicted_categories"].get(c, 0)
                if d or pr:
                    print(f"| {r['run']} | {c} | {d / 1e9:.3f} | {pr / 1e9:.3f} | {(pr - d) / 1e9:+.3f} |")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
