"""Capture overhead on a real Trainer job, as users run it: plain ``torchrun`` vs ``oomdoctor run -- torchrun``.

The job is ``scenarios/trainer_gpt2.py``: Hugging Face Trainer, GPT-2 124M (12 x 768, 50,257 vocabulary),
bf16, AdamW, DDP over 2 GPUs, micro-batch 8 x 1024 tokens. Runs alternate plain / recorded (the order
rotates every repetition, so drift hits all). Rank 0 notes the wall time at the end of every step after
a ``torch.cuda.synchronize()``; a run's figure is the median duration of steps 6..N. The recorded runs
use ``oomdoctor run``'s defaults (Python stacks at allocations only, 100,000-event ring buffer), and the
sidecars say how long the dump at exit took.

    python benchmarks/bench_trainer_overhead.py --out docs/bench_trainer_overhead.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAINER = ROOT / "scenarios" / "trainer_gpt2.py"


MODES = {"plain": None, "oomdoctor": [], "oomdoctor-nostacks": ["--stacks", "none"]}


def run(mode: str, steps: int, nproc: int, work: Path, i: int, extra: list[str]) -> dict:
    times, out = work / f"times-{mode}-{i}.json", work / f"out-{mode}-{i}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(TRAINER),
           "--steps", str(steps), "--times", str(times), "--output-dir", str(work / "hf"), *extra]
    if MODES[mode] is not None:
        cmd = [sys.executable, "-m", "oomdoctor", "run", "--out", str(out), "--no-diagnose", *MODES[mode], "--", *cmd]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=str(ROOT))
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run {i} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    ends = json.loads(times.read_text())["step_end_s"]
    durations = [b - a for a, b in zip(ends, ends[1:])]  # durations[k] is step k+2 (1-based)
    res = {"mode": mode, "rep": i, "wall_s": wall, "median_step_s": statistics.median(durations[4:]),
           "step_s": durations}
    if MODES[mode] is not None:
        metas = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.meta.json"))]
        res["dump"] = [m.get("dump") for m in metas]
        res["snapshot_bytes"] = [p.stat().st_size for p in sorted(out.glob("rank*.pickle"))]
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--modes", default="plain,oomdoctor", help=f"comma-separated, from {', '.join(MODES)}")
    p.add_argument("extra", nargs="*", help="more arguments for trainer_gpt2.py (after --)")
    a = p.parse_args()
    modes = a.modes.split(",")
    if "plain" not in modes or not set(modes) <= set(MODES):
        raise SystemExit(f"--modes: 'plain' and any of {', '.join(MODES)}")
    runs = []
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        for i in range(a.reps):
            for mode in modes[i % len(modes):] + modes[:i % len(modes)]:  # the order rotates every repetition
                r = run(mode, a.steps, a.nproc, work, i, a.extra)
                runs.append(r)
                print(json.dumps({k: v for k, v in r.items() if k != "step_s"}), flush=True)
    med = {m: statistics.median(r["median_step_s"] for r in runs if r["mode"] == m) for m in modes}
    plain = {r["rep"]: r["median_step_s"] for r in runs if r["mode"] == "plain"}
    per_rep = {m: [r["median_step_s"] / plain[r["rep"]] for r in runs if r["mode"] == m] for m in modes if m != "plain"}
    import torch
    res = {"gpu": torch.cuda.get_device_name(0), "gpus": a.nproc, "torch": torch.__version__,
           "transformers": __import__("transformers").__version__, "steps": a.steps, "reps": a.reps,
           "median_step_s": med, "overhead_ratio_median": {m: med[m] / med["plain"] for m in per_rep},
           "overhead_ratio_per_rep": per_rep, "runs": runs}
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "runs"}, indent=2))


if __name__ == "__main__":
    main()
