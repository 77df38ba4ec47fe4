"""``oomdoctor tune`` against an exhaustive grid of short runs over the same space, on the same GPU (issue 51's "done
when"): the throughput of tune's measured best against the grid's best, the GPU time each took, tune's trials that ran
out of memory unpredicted, and for every configuration of the grid the predicted peak reserved against PyTorch's
``max_memory_reserved`` and the predicted throughput against the measured one.

    python benchmarks/tune_vs_grid.py OUTDIR --part gpt2|vit|llama [--top K] [--steps S] [--warmup W] [--jobs J]
    python benchmarks/tune_vs_grid.py OUTDIR --part gpt2|vit --from-archive    # the summary again, from a run's files

- ``gpt2``: GPT-2 medium (``benchmarks/tune_jobs/gpt2-medium.json``), Hugging Face Trainer, 1 GPU, sequence 1024,
  global batch 16: micro-batch 4, 8, 16 x checkpointing none, full x AdamW fused, foreach (12 configurations);
- ``vit``: torchvision's ViT-B/16 script (``benchmarks/tune_jobs/vit_train.py``), 1 GPU, global batch 256: micro-batch
  32, 64, 128, 256 x checkpointing none, full (8);
- ``llama``: a 0.95B Llama-shaped decoder (``benchmarks/tune_jobs/llama_fsdp_train.py``), 2 GPUs under torchrun,
  sequence 2048, global batch 32: micro-batch 8, 16 x DDP, FSDP2 full shard x checkpointing none, full (8; the
  script's FSDP2 without resharding is left out to keep the grid within about 5 minutes).

The allocator axis is the default setting only (the grid would run every allocator setting of every configuration at
the same speed). tune runs first (its traces on the CPU, then its top K for real), then the grid runs every
configuration with the same runner, steps and timing (:func:`oomdoctor.cli.tune_exec.run_candidates`). GPU time is
the runs' wall time, start included. Writes ``OUTDIR/PART/{tune.json,tune.log,grid.json,summary.json}`` and the runs'
logs; prints the summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
JOBS = ROOT / "benchmarks" / "tune_jobs"


def tune_argv(part: str, smoke: bool = False) -> list[str]:
    py = sys.executable
    if smoke:  # the driver itself on a CPU, in minutes: a ViT on 32 x 32 images (no GPU: tune runs nothing)
        return ["--knob", "mb=2,4", "--knob", "ac=none,full", "--global-batch", "4", "--allocator", "defaults",
                "--gpu", "H200", "--", py, str(JOBS / "vit_train.py"), "--bs", "{mb}", "--ga", "{ga}", "--ac",
                "{ac}", "--image", "32"]
    if part == "gpt2":
        return ["--hf-config", str(JOBS / "gpt2-medium.json"), "--seq-len", "1024", "--global-batch", "16",
                "--micro-batch", "4,8,16", "--checkpointing", "none,full", "--optimizer", "fused,foreach",
                "--allocator", "defaults", "--gpu", "H200"]
    if part == "vit":
        return ["--knob", "mb=32,64,128,256", "--knob", "ac=none,full", "--global-batch", "256", "--allocator",
                "defaults", "--gpu", "H200", "--", py, str(JOBS / "vit_train.py"), "--bs", "{mb}", "--ga", "{ga}",
                "--ac", "{ac}"]
    if part == "llama":
        return ["--knob", "mb=8,16", "--knob", "shard=ddp,full", "--knob", "ac=none,full",
                "--global-batch", "32", "--allocator", "defaults", "--gpu", "H200", "--", py, "-m",
                "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(JOBS / "llama_fsdp_train.py"),
                "--bs", "{mb}", "--ga", "{ga}", "--shard", "{shard}", "--ac", "{ac}"]
    raise SystemExit(f"unknown part {part}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--part", required=True, choices=["gpt2", "vit", "llama"])
    ap.add_argument("--top", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=12)
    ap.add_argument("--trial-timeout", type=float, default=180)
    ap.add_argument("--tune-timeout", type=float, default=300)
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a tiny ViT on the CPU: checks this script, measures nothing")
    ap.add_argument("--from-archive", action="store_true",
                    help="run nothing: print the summary made again from OUT/PART's summary, tune and grid JSON")
    a = ap.parse_args()
    out = Path(a.out) / a.part
    if a.from_archive:
        print(json.dumps(from_archive(out), indent=1))
        return
    out.mkdir(parents=True, exist_ok=True)

    # 1. tune: traces on the CPU, the top K for real
    argv = ["tune", *tune_argv(a.part, a.smoke)]
    dash = argv.index("--") if "--" in argv else len(argv)
    opts = ["--top", str(a.top), "--steps", str(a.steps), "--warmup", str(a.warmup), "-j", str(a.jobs),
            "--out", str(out / "tune-runs"), "--trial-timeout", str(a.trial_timeout), "--format", "json",
            "-o", str(out / "tune.json")]
    argv = argv[:dash] + opts + argv[dash:]
    t0 = time.monotonic()
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    try:
        p = subprocess.run([sys.executable, "-m", "oomdoctor", *argv], capture_output=True, text=True,
                           timeout=a.tune_timeout)
    except subprocess.TimeoutExpired as e:
        (out / "tune.log").write_text(f"tune timed out after {a.tune_timeout} s\n{e.stdout or ''}{e.stderr or ''}")
        raise SystemExit(f"tune timed out after {a.tune_timeout} s") from None
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    tune_wall = time.monotonic() - t0
    (out / "tune.log").write_text(p.stdout + p.stderr)
    print(f"tune rc={p.returncode} in {tune_wall:.1f} s; CPU {r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime:.1f} s",
          flush=True)
    if not (out / "tune.json").exists():
        print(p.stderr[-3000:])
        raise SystemExit(1)
    tuned = json.loads((out / "tune.json").read_text())
    summary = {"part": a.part, "tune_argv": argv, "tune_rc": p.returncode, "tune_wall_s": round(tune_wall, 1),
               "tune_cpu_s": round(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime, 1),
               "tune_trace_s": tuned["trace_seconds"], "tune_gpu_s": tuned["gpu_seconds"],
               "tune_traces": len(tuned["traces"]), "tune_trials": len(tuned["trials"]),
               "tune_measured": tuned["measured"], "tune_best": tuned["best"] and tuned["best"]["config"],
               "tune_best_measured_samples_per_s": tuned["best"] and tuned["best"]["measured_samples_per_s"],
               "tune_unpredicted_ooms": sum(1 for t in tuned["trials"] if t["unpredicted_oom"])}
    if a.skip_grid:
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(json.dumps(summary, indent=1))
        return

    # 2. the grid: every configuration, the same runner
    from oomdoctor.cli.tune_exec import hf_command, run_candidates, substitute
    from oomdoctor.report.tune import Candidate

    cands = [Candidate(**{**c, "measured_samples_per_s": None}) for c in tuned["candidates"]
             if c["config"].get("allocator") == "defaults"]
    space = tuned["space"]
    if space["mode"] == "hf":
        job = tuned["job"]

        def command_of(cfg):
            return hf_command(cfg, hf_config=job["hf_config"], seq_len=job["seq_len"], dtype=job["dtype"],
                              world_size=space["world_size"])
    else:
        cmd = tuned["job"]["command"]

        def command_of(cfg):
            return substitute(cmd, cfg)
    g0 = time.monotonic()
    rows = []
    for i, c in enumerate(cands):  # one at a time, written after each: a part cut by its time limit keeps its rows
        [t] = run_candidates([c], command_of, str(out / "grid-runs" / f"config{i + 1}"), steps=a.steps,
                             warmup=a.warmup, timeout_s=a.trial_timeout)
        rows.append({"config": c.config, "fits_predicted": c.fits, "memory_basis": c.memory_basis,
                     "predicted_peak_reserved_bytes": c.predicted_peak_reserved_bytes,
                     "measured_peak_reserved_bytes": t.measured_peak_reserved_bytes,
                     "peak_error": (c.predicted_peak_reserved_bytes / t.measured_peak_reserved_bytes - 1)
                     if t.measured_peak_reserved_bytes else None,
                     "predicted_samples_per_s": c.predicted_samples_per_s,
                     "measured_samples_per_s": t.measured_samples_per_s, "outcome": t.outcome, "seconds": t.seconds,
                     "timed_seconds": t.timed_seconds, "log": t.log})
        (out / "grid.json").write_text(json.dumps(rows, indent=1))
    grid_wall = time.monotonic() - g0
    summary.update(grid_summary(tuned, rows, grid_wall))
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))


def grid_summary(tuned: dict, rows: list[dict], grid_wall: float) -> dict:
    """What the grid says of tune's answer (the module doc): throughput, GPU time, out-of-memory runs, peaks against
    the predictions and the margin, the cost model's ranking."""
    from oomdoctor.report.tune import within_margin

    margin = tuned["margin_bytes"]
    for r in rows:  # the margin covers an under-prediction when measured <= predicted + margin
        r["within_margin"] = within_margin(r["measured_peak_reserved_bytes"], r["predicted_peak_reserved_bytes"], margin)
    ran = [r for r in rows if r["measured_samples_per_s"]]
    best = max(ran, key=lambda r: r["measured_samples_per_s"]) if ran else None
    grid_gpu = sum(r["seconds"] for r in rows)
    tune_best = tuned["best"] and tuned["best"]["measured_samples_per_s"]
    return {
        "grid_runs": len(rows), "grid_gpu_s": round(grid_gpu, 1), "grid_wall_s": round(grid_wall, 1),
        "grid_best": best and best["config"], "grid_best_samples_per_s": best and best["measured_samples_per_s"],
        "tune_over_grid_throughput": (tune_best / best["measured_samples_per_s"]) if best and tune_best else None,
        "tune_over_grid_gpu_time": tuned["gpu_seconds"] / grid_gpu if grid_gpu else None,
        "grid_oom": [r["config"] for r in rows if r["outcome"] == "oom"],
        "grid_oom_predicted_to_fit": [r["config"] for r in rows if r["outcome"] == "oom" and r["fits_predicted"]],
        "peak_errors": [round(r["peak_error"], 5) for r in rows if r["peak_error"] is not None],
        "margin_bytes": margin,
        "largest_under_prediction_bytes": max((r["measured_peak_reserved_bytes"] - r["predicted_peak_reserved_bytes"]
                                               for r in rows if r["measured_peak_reserved_bytes"]), default=None),
        "peaks_within_margin": sum(1 for r in rows if r["within_margin"]),
        "peaks_measured": sum(1 for r in rows if r["within_margin"] is not None),
        "spearman_predicted_vs_measured": _spearman([r["predicted_samples_per_s"] for r in ran],
                                                    [r["measured_samples_per_s"] for r in ran]),
        "predicted_rank_of_grid_best": _rank_of(rows, best),
        "predicted_over_measured_samples_per_s": [round(r["predicted_samples_per_s"] / r["measured_samples_per_s"], 3)
                                                  for r in ran],
    }


def from_archive(part_dir: Path) -> dict:
    """A part's summary made again from what its run left (``summary.json``, ``tune.json``, ``grid.json``): the
    tune side as it was measured, the grid side by :func:`grid_summary` (fields added since are filled)."""
    summary = json.loads((part_dir / "summary.json").read_text())
    tuned = json.loads((part_dir / "tune.json").read_text())
    rows = json.loads((part_dir / "grid.json").read_text())
    summary.update(grid_summary(tuned, rows, summary.get("grid_wall_s", 0.0)))
    return summary


def _rank_of(rows: list[dict], best: dict | None) -> int | None:
    if best is None:
        return None
    order = sorted((r for r in rows if r["fits_predicted"]), key=lambda r: -r["predicted_samples_per_s"])
    return next((i + 1 for i, r in enumerate(order) if r["config"] == best["config"]), None)


def _spearman(x: list[float], y: list[float]) -> float | None:
    if len(x) < 3:
        return None

    def ranks(v: list[float]) -> list[float]:
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for k, i in enumerate(order):
            r[i] = float(k)
        return r

    rx, ry = ranks(x), ranks(y)
    n = len(x)
    mx, my = sum(rx) / n, sum(ry) / n
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    vx = sum((a - mx) ** 2 for a in rx) ** 0.5
    vy = sum((b - my) ** 2 for b in ry) ** 0.5
    return round(cov / (vx * vy), 3) if vx and vy else None


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
