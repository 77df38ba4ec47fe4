"""``diagnose`` on a third-party loop recorded here and now: the accelerate job (scenarios/accelerate_llama.py)
under ``oomdoctor run`` on one GPU, with its own ground truth.

- at a small micro-batch: verdict ``healthy``; parameter, gradient and optimizer-state bytes within 5% of what
  the job counted, from the trace alone and with the storages the recorder noted (``sources`` say
  ``recorded``);
- at a micro-batch whose activations need 1.25 times the device's room: verdict ``capacity``; its trace ends
  inside the first forward pass, so no fit is replayed from it (and the report says why);
- at half that micro-batch: ``healthy``, and the largest micro-batch the replay says fits really runs.

Run: ``python -m pytest -m gpu tests/gpu/test_diagnose_gpu.py -v`` (results in docs/diagnose.md). With
``OOMDOCTOR_SCENARIO_LOG=FILE`` each run appends one JSON line to FILE.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scenarios" / "accelerate_llama.py"
SHAPE = ("--layers", "4", "--width", "1024", "--seq", "2048", "--steps", "2", "--grad-accum", "1")


@pytest.fixture(autouse=True)
def needs_accelerate():
    pytest.importorskip("accelerate")
    pytest.importorskip("transformers")


def run(tmp_path: Path, name: str, batch: int) -> dict:
    out = tmp_path / name
    out.mkdir()
    cmd = [sys.executable, "-m", "oomdoctor", "run", "--out", str(out), "--no-diagnose", "--", sys.executable,
           str(SCRIPT), *SHAPE, "--batch", str(batch), "--ground-truth", str(out / "ground_truth.json")]
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=500, cwd=str(ROOT),
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0")))
    truth = json.loads((out / "ground_truth.json").read_text())
    rec = {"run": name, "batch": batch, "exit_code": proc.returncode, "wall_s": round(time.time() - t0, 1), **truth}
    if os.environ.get("OOMDOCTOR_SCENARIO_LOG"):
        with open(os.environ["OOMDOCTOR_SCENARIO_LOG"], "a") as f:
            f.write(json.dumps(rec) + "\n")
    rec["out"] = out
    return rec


def model_state(report) -> dict[str, int]:
    bds = report.ranks[0].breakdowns
    return {"parameters": max(b.categories["parameters"] for b in bds),
            "gradients": max([b.categories["gradients"] for b in bds if b.at == "optimizer_start"] or [0]),
            "optimizer_state": max(b.categories["optimizer_state"] for b in bds)}


def test_a_recorded_third_party_loop_is_diagnosed_right(tmp_path):
    from oomdoctor.report import build_report
    from oomdoctor.trace import load_ranks

    small = run(tmp_path, "small", 4)
    assert small["exit_code"] == 0
    report = build_report(load_ranks([small["out"]], skipped=[]), micro_batch=4)
    assert report.verdict.kind == "healthy"
    got = model_state(report)
    for c in got:
        assert abs(got[c] - small[f"{c}_bytes"]) <= 0.05 * small[f"{c}_bytes"], (c, got[c], small[f"{c}_bytes"])
    assert report.ranks[0].breakdowns[-1].sources["parameters"] == "recorded"
    traces = load_ranks([small["out"]], skipped=[])
    for t in traces:
        t.meta.pop("tensors")
    got = model_state(build_report(traces))
    for c in got:
        assert abs(got[c] - small[f"{c}_bytes"]) <= 0.05 * small[f"{c}_bytes"], (c, got[c], small[f"{c}_bytes"])
    # a micro-batch far too large: capacity, and what the replay says fits does run
    fixed = small["parameters_bytes"] + small["gradients_bytes"] + small["optimizer_state_bytes"]
    per_sample = (small["max_memory_allocated"] - fixed) / 4
    big_batch = int(1.25 * (small["gpu_total_memory_bytes"] - fixed) / per_sample)
    big = run(tmp_path, "big", big_batch)
    assert big["exit_code"] != 0 and big["oom"]
    report = build_report(load_ranks([big["out"]], skipped=[]), micro_batch=big_batch)
    assert report.verdict.kind == "capacity"
    f = report.ranks[0].fits
    # cut in its first forward pass: no replayed answer, at most a lower bound (notes are ids since issue 37)
    assert f.largest_micro_batch is None
    assert {"first-forward-estimate", "cut-in-first-forward"} & set(f.notes), f.notes
    half = run(tmp_path, "half", big_batch // 2)
    assert half["exit_code"] == 0
    if f.estimated_largest_micro_batch is not None:  # a lower bound is never above what ran
        assert f.bound == "lower" and f.estimated_largest_micro_batch <= big_batch // 2, f
    report = build_report(load_ranks([half["out"]], skipped=[]), micro_batch=big_batch // 2)
    assert report.verdict.kind == "healthy"
    largest = report.ranks[0].fits.largest_micro_batch
    assert largest is not None and big_batch // 2 <= largest < big_batch
    fits = run(tmp_path, "fits", largest)
    assert fits["exit_code"] == 0, fits
