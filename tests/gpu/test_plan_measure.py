"""``oomdoctor plan`` against the GPU: a Llama-3.2-1B-shaped model under FSDP2 / TP / PP, measured vs
predicted (``benchmarks/measure_plan_gpu.py``; the numbers are recorded in docs/plan.md).

Run on a machine with 2 or 4 GPUs: ``python -m pytest -m gpu tests/gpu/test_plan_measure.py -v``.
With 4 GPUs it also runs the 2-D (FSDP x TP) and pipeline configurations.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "measure_plan_gpu.py"


def test_plan_predicts_measured_memory(tmp_path):
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        pytest.skip("needs 2 GPUs")
    configs = ["fsdp2", "tp2"] + (["fsdp2-tp2", "pp2-fsdp2"] if gpus >= 4 else [])
    out = tmp_path / "plan_gpu.json"
    args = [sys.executable, str(SCRIPT), "run", "--steps", "3", "--json", str(out)]
    for c in configs:
        args += ["--config", c]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert sorted({r["config"] for r in rows}) == sorted(configs)
    for r in rows:
        # the terms: what the allocator hands out
        assert abs(r["allocated_error"]) <= 0.10, (r["config"], r["rank"], r["allocated_error"])
        # plus the fragmentation margin: what the job reserves
        assert abs(r["reserved_error"]) <= 0.25, (r["config"], r["rank"], r["reserved_error"])
        assert r["num_alloc_retries"] == 0
    # the pipeline's last stage holds the logits and the loss; stage 0 does not
    pp = {r["stage"]: r for r in rows if r["config"] == "pp2-fsdp2"}
    if pp:
        assert pp[1]["measured_reserved_bytes"] > pp[0]["measured_reserved_bytes"]
        assert pp[1]["predicted_reserved_bytes"] > pp[0]["predicted_reserved_bytes"]
