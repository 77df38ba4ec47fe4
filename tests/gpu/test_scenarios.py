"""Every scenario under ``oomdoctor run`` on 2 GPUs: the pathology is reported, its fix is not.

Run on a machine with 2 GPUs: ``python -m pytest -m gpu tests/gpu -v``. With
``OOMDOCTOR_SCENARIO_LOG=FILE`` each run appends its measured numbers (one JSON line) to FILE; they
are recorded in docs/scenarios.md.
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
SCENARIOS = ROOT / "scenarios"


def _gpus() -> int:
    import torch
    return torch.cuda.device_count()


@pytest.fixture(autouse=True)
def two_gpus():
    if _gpus() < 2:
        pytest.skip("needs 2 GPUs")


def oomdoctor(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True, text=True, **kw)


def run_scenario(tmp_path: Path, script: str, variant: str, *extra: str) -> dict:
    out = tmp_path / f"{script}-{variant}"
    t0 = time.time()
    proc = oomdoctor("run", "--out", str(out), "--no-diagnose", *extra, "--", sys.executable, "-m",
                     "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                     str(SCENARIOS / f"{script}.py"), "--variant", variant, cwd=str(SCENARIOS), timeout=400)
    wall = time.time() - t0
    diag = oomdoctor("diagnose", "--format", "json", str(out))
    assert diag.returncode == 0, diag.stderr[-2000:]
    report = json.loads(diag.stdout)
    rec = {"scenario": script, "variant": variant, "exit_code": proc.returncode, "wall_s": round(wall, 1),
           "files": sorted(p.name for p in out.iterdir() if not p.name.startswith(".")),
           "ranks": [{k: r[k] for k in ("rank", "peak_allocated_bytes", "peak_reserved_bytes", "events", "steps",
                                        "step_source")} | {"oom": r["oom"] is not None} for r in report["ranks"]],
           "findings": [{"id": f["id"], "ranks": f["ranks"], "bytes": f["bytes"], "severity": f["severity"]}
                        for f in report["findings"]]}
    if os.environ.get("OOMDOCTOR_SCENARIO_LOG"):
        with open(os.environ["OOMDOCTOR_SCENARIO_LOG"], "a") as f:
            f.write(json.dumps(rec) + "\n")
    rec.update(out=out, stderr=proc.stderr, report=report)
    return rec


def ids(rec: dict) -> set[str]:
    return {f["id"] for f in rec["findings"]}


def test_tp_allreduce(tmp_path):
    legacy = run_scenario(tmp_path, "tp_allreduce", "legacy")
    modern = run_scenario(tmp_path, "tp_allreduce", "modern")
    assert legacy["exit_code"] == modern["exit_code"] == 0
    assert "deferred-free" in ids(legacy) and "deferred-free" not in ids(modern)
    for r in legacy["ranks"]:
        assert r["peak_reserved_bytes"] > 1.5 * r["peak_allocated_bytes"]
    for r in modern["ranks"]:
        assert r["peak_reserved_bytes"] < 1.1 * r["peak_allocated_bytes"]
    meta = json.loads((legacy["out"] / "rank1.meta.json").read_text())
    assert meta["rank"] == 1 and meta["world_size"] == 2 and meta["gpu_total_memory_bytes"] > 0
    assert meta["torch_version"] and meta["memory_stats"]["num_alloc_retries"] == 0


def test_pipeline_outputs(tmp_path):
    cached = run_scenario(tmp_path, "pipeline_outputs", "return-outputs")
    flat = run_scenario(tmp_path, "pipeline_outputs", "no-return-outputs")
    assert cached["exit_code"] == flat["exit_code"] == 0
    (f,) = [f for f in cached["findings"] if f["id"] == "pipeline-output-cache"]
    assert f["ranks"] == [1]
    assert "pipeline-output-cache" not in ids(flat)


def test_fragmentation_oom(tmp_path):
    default = run_scenario(tmp_path, "fragmentation_oom", "default")
    expandable = run_scenario(tmp_path, "fragmentation_oom", "expandable")
    assert default["exit_code"] != 0 and expandable["exit_code"] == 0
    assert "rank0_oom.pickle" in default["files"] and "OutOfMemoryError" in default["stderr"]
    assert any(r["oom"] for r in default["ranks"])
    assert "fragmentation" in ids(default) and "fragmentation" not in ids(expandable)
    assert not any(r["oom"] for r in expandable["ranks"])
    meta = json.loads((default["out"] / "rank0_oom.meta.json").read_text())
    assert meta["kind"] == "oom" and meta["memory_cap_bytes"] == meta["oom"]["device_limit_bytes"]


def test_allgather(tmp_path):
    lst = run_scenario(tmp_path, "allgather_list", "list")
    ten = run_scenario(tmp_path, "allgather_list", "tensor")
    assert "allgather-list" in ids(lst) and "allgather-list" not in ids(ten)


def test_ddp_debug_buffer_and_summary(tmp_path):
    bug = run_scenario(tmp_path, "ddp_debug_buffer", "debug-buffer", "--summarize")
    clean = run_scenario(tmp_path, "ddp_debug_buffer", "clean")
    (f,) = [f for f in bug["findings"] if f["id"] == "rank-imbalance"]
    assert f["ranks"] == [0]
    assert "rank-imbalance" not in ids(clean)
    summary = json.loads((bug["out"] / "summary.json").read_text())
    assert {f["id"] for f in summary["findings"]} == ids(bug)
    assert [r["peak_allocated_bytes"] for r in summary["ranks"]] == [r["peak_allocated_bytes"] for r in bug["ranks"]]
    assert bug["ranks"][0]["step_source"] == "markers" and bug["ranks"][0]["steps"] >= 12


def test_fsdp(tmp_path):
    one = run_scenario(tmp_path, "fsdp", "fsdp1")
    two = run_scenario(tmp_path, "fsdp", "fsdp2")
    assert one["exit_code"] == two["exit_code"] == 0
    assert "deferred-free" not in ids(two)


def test_step_leak(tmp_path):
    leak = run_scenario(tmp_path, "step_leak", "leak")
    fixed = run_scenario(tmp_path, "step_leak", "fixed")
    assert "memory-growth" in ids(leak) and "memory-growth" not in ids(fixed)


def test_summary_names_a_dead_rank(tmp_path):
    """Rank 1 dies without a word; rank 0's summary says so after the timeout instead of hanging."""
    script = tmp_path / "die.py"
    script.write_text("import os, torch\nx = torch.ones(1 << 20, device=f\"cuda:{os.environ['LOCAL_RANK']}\")\n"
                      "if os.environ['RANK'] == '1':\n    os._exit(3)\n")
    out = tmp_path / "died"
    from oomdoctor.cli.run import child_env
    env = child_env(str(out), None, 1000, "python", True, 5.0)  # as `oomdoctor run --summarize` sets it
    procs = [subprocess.Popen([sys.executable, str(script)], env={**env, "RANK": str(r), "LOCAL_RANK": str(r),
                                                                   "WORLD_SIZE": "2"}) for r in (0, 1)]
    t0 = time.time()
    codes = [p.wait(timeout=120) for p in procs]
    assert codes == [0, 3] and time.time() - t0 < 60
    summary = json.loads((out / "summary.json").read_text())
    assert [r["rank"] for r in summary["ranks"]] == [0]
    assert any("rank 1" in n for n in summary["notes"])
