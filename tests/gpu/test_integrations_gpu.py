"""The framework callbacks and the pytest marker on a GPU, with the real frameworks.

- A Hugging Face Trainer job and a Lightning job (``scenarios/callback_trainer.py``,
  ``scenarios/callback_lightning.py``), each with one added line: recorded over a step window with an
  evaluation in it, the diagnosis printed at the end; the same job's loss without the callback;
  an induced OOM (a memory cap with a batch that cannot fit): the OOM snapshot is written and the
  diagnosis printed after the traceback (Trainer) or from ``on_exception`` (Lightning).
- ``@pytest.mark.limit_cuda_memory``: a test over its limit fails with the holders and a snapshot,
  one under it passes, ``--cuda-memory-report`` prints both.

Run: ``python -m pytest -m gpu tests/gpu/test_integrations_gpu.py -v`` (results in docs/integrations.md).
With ``OOMDOCTOR_SCENARIO_LOG=FILE`` each run appends one JSON line to FILE.
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
SMALL = ("--layers", "6", "--seq", "512")


def log(rec: dict) -> None:
    if os.environ.get("OOMDOCTOR_SCENARIO_LOG"):
        with open(os.environ["OOMDOCTOR_SCENARIO_LOG"], "a") as f:
            f.write(json.dumps(rec) + "\n")


def job(script: str, *args: str, name: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
               CUDA_VISIBLE_DEVICES=os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0])
    t0 = time.time()
    proc = subprocess.run([sys.executable, str(ROOT / "scenarios" / script), *args], capture_output=True, text=True,
                          timeout=500, cwd=str(ROOT), env=env)
    result = next((json.loads(x[7:]) for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    rec = {"run": name, "args": list(args), "exit_code": proc.returncode, "wall_s": round(time.time() - t0, 1),
           "result": result, "stdout_tail": proc.stdout[-3000:], "stderr_tail": proc.stderr[-4000:]}
    log(rec)
    return dict(rec, stderr=proc.stderr)


@pytest.mark.parametrize("script,frame", [("callback_trainer.py", "transformers"),
                                          ("callback_lightning.py", "lightning")])
def test_a_callback_records_marks_and_diagnoses(tmp_path, script, frame):
    pytest.importorskip(frame)
    from oomdoctor import diagnose

    out = tmp_path / "mem"
    every = "--eval-steps" if frame == "transformers" else "--val-every"
    run = job(script, *SMALL, "--batch", "4", "--steps", "8", every, "4", "--window", "2:5", "--out", str(out),
              name=f"{frame}-window")
    assert run["exit_code"] == 0, run["stderr_tail"]
    assert run["result"]["steps"] == 8
    snap = out / "rank0_step5.pickle"
    assert snap.exists() and (out / "summary.json").exists()
    meta = json.loads((out / "rank0_step5.meta.json").read_text())
    assert meta["micro_batch"] == 4
    assert "evaluation" in [m["phase"] for m in meta["phase_markers"]]
    assert [m["step"] for m in meta["step_markers"]][:7] == list(range(7))
    d = diagnose(str(snap))
    assert d.verdict.kind == "healthy"
    assert d.ranks[0].steps is not None and d.ranks[0].step_source == "markers"
    assert "oomdoctor: HEALTHY on rank 0." in run["stdout_tail"]
    assert "Largest holders:" in run["stdout_tail"]
    plain = job(script, *SMALL, "--batch", "4", "--steps", "8", every, "4", "--no-callback", name=f"{frame}-plain")
    assert plain["exit_code"] == 0
    log({"run": f"{frame}-same-loss", "with": run["result"]["loss"], "without": plain["result"]["loss"]})
    assert abs(run["result"]["loss"] - plain["result"]["loss"]) <= 1e-3 * abs(plain["result"]["loss"])


@pytest.mark.parametrize("script,frame", [("callback_trainer.py", "transformers"),
                                          ("callback_lightning.py", "lightning")])
def test_a_callback_dumps_and_diagnoses_an_induced_oom(tmp_path, script, frame):
    pytest.importorskip(frame)
    from oomdoctor import diagnose

    out = tmp_path / "mem"
    run = job(script, "--batch", "48", "--steps", "4", "--cap-gib", "6", "--out", str(out), name=f"{frame}-oom")
    assert run["exit_code"] != 0
    assert "OutOfMemoryError" in run["stderr_tail"]
    oom = out / "rank0_oom.pickle"
    assert oom.exists()
    text = run["stderr"]
    last = text[text.rfind("OutOfMemoryError"):]  # the diagnosis comes (again) below the traceback
    assert "oomdoctor: CAPACITY on rank 0." in last or "oomdoctor: FRAGMENTATION on rank 0." in last, text[-4000:]
    if frame == "lightning":  # and first from on_exception, before Lightning re-raises
        assert text.count("oomdoctor: CAPACITY on rank 0.") + text.count("oomdoctor: FRAGMENTATION on rank 0.") == 2
    assert f"Snapshot: {oom}" in text.replace("\n  ", " ")
    d = diagnose(str(oom))
    assert d.verdict.kind in ("capacity", "fragmentation")
    assert d.ranks[0].fits.room_bytes <= 6 * 2**30 + 2**20


LIMIT_TESTS = '''
import pytest
import torch

@pytest.mark.limit_cuda_memory("1 GiB")
def test_over():
    keep = [torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda") for _ in range(6)]  # 1.5 GiB
    del keep

@pytest.mark.limit_cuda_memory("1 GiB")
def test_under():
    x = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")
    del x

@pytest.mark.limit_cuda_memory("600 MiB", measure="reserved")
def test_reserved_over():
    x = torch.empty(700 * 2**20, dtype=torch.uint8, device="cuda")
    del x
'''


def test_limit_cuda_memory_marker_on_gpu(tmp_path):
    (tmp_path / "test_limits.py").write_text(LIMIT_TESTS)
    snaps = tmp_path / "snaps"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "oomdoctor.pytest_plugin", "-p", "no:cacheprovider",
                           "-q", "--cuda-memory-report", "--cuda-memory-snapshots", str(snaps), "test_limits.py"],
                          capture_output=True, text=True, timeout=300, cwd=str(tmp_path), env=env)
    out = proc.stdout
    log({"run": "pytest-limit_cuda_memory", "exit_code": proc.returncode, "stdout_tail": out[-6000:]})
    assert proc.returncode == 1, out
    assert "2 failed, 1 passed" in out
    assert "exceeds its limit: 1.50 GiB > 1.00 GiB" in out
    assert "largest holders:" in out and "test_limits.py:7" in out
    written = sorted(p.name for p in snaps.rglob("rank0.pickle"))
    assert len(written) == 2
    assert "CUDA memory per test (oomdoctor)" in out and "test_limits.py::test_under" in out
