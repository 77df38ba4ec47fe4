"""``oomdoctor fit`` and ``oomdoctor verify`` on real GPU jobs (``scenarios/fit_job.py``,
``scenarios/fragmentation_oom.py``). Run on the device: ``python -m pytest -m gpu tests/gpu/test_loop_gpu.py -v``
(about 4 minutes on an H100; the torchrun test needs 2 GPUs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]
JOB = str(ROOT / "scenarios" / "fit_job.py")


def oomdoctor(*args: str, timeout: float = 540) -> tuple[int, dict, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-m", "oomdoctor", *args], capture_output=True, text=True, timeout=timeout,
                       env=env, cwd=ROOT)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = {}
    return p.returncode, doc, p.stderr


def test_fit_finds_a_micro_batch_that_runs_next_to_one_that_does_not(tmp_path):
    code, doc, err = oomdoctor("fit", "--steps", "2", "--start", "32", "--high", "512", "--out", str(tmp_path),
                               "--format", "json", "--", sys.executable, JOB, "--harness", "plain", "--batch", "{mb}")
    assert code == 0, err[-3000:]
    assert doc["snapshot"] is True and doc["guide"] in ("replayed", "lower-bound")
    assert doc["smallest_oom_micro_batch"] == doc["largest_micro_batch"] + 1
    assert doc["trials"][0]["recorded"] and doc["trials"][0]["micro_batch"] == 32
    # every trial that ran stopped itself after 2 optimizer steps (the job asks for 1000)
    assert all(t["stopped"] for t in doc["trials"] if t["outcome"] == "ran")
    assert all(t["outcome"] != "failed" for t in doc["trials"])
    print(json.dumps({k: doc[k] for k in ("largest_micro_batch", "predicted_micro_batch", "guide", "trial_count",
                                          "seconds", "analysis_seconds")}))


def test_verify_confirms_expandable_segments_on_a_fragmentation_oom(tmp_path):
    code, doc, err = oomdoctor("verify", "--steps", "14", "--setting", "expandable_segments:True", "--out",
                               str(tmp_path), "--format", "json", "--", sys.executable,
                               str(ROOT / "scenarios" / "fragmentation_oom.py"), "--variant", "default")
    assert doc, err[-3000:]
    assert doc["snapshot"] is True and doc["baseline"]["outcome"] == "oom"
    s = doc["settings"][0]
    print(json.dumps({k: s[k] for k in ("predicted_peak_reserved_bytes", "margin_bytes", "measured_peak_reserved_bytes",
                                        "oom", "confirmed", "why")}))
    assert s["oom"] is False and s["measured_peak_reserved_bytes"] is not None
    assert s["confirmed"] is True and code == 0


def test_every_rank_of_a_torchrun_job_stops_after_k_steps(tmp_path):
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    code, doc, err = oomdoctor("verify", "--steps", "2", "--setting", "expandable_segments:True", "--out",
                               str(tmp_path), "--format", "json", "--", sys.executable, "-m", "torch.distributed.run",
                               "--nproc_per_node=2", JOB, "--harness", "plain", "--ddp", "--batch", "8")
    assert doc, err[-3000:]
    for t in (doc["baseline"], doc["settings"][0]["trial"]):
        log = Path(t["log"]).read_text()
        assert t["outcome"] == "ran" and t["exit_code"] == 0 and not t["timed_out"], log[-3000:]
        assert log.count("stopped after 2 optimizer steps") == 2
        assert t["measured_peak_reserved_bytes"] > 0
    assert doc["snapshot"] is True
    assert len(list((tmp_path / "baseline").glob("rank*.pickle"))) == 2


VIT = str(ROOT / "scenarios" / "vit_job.py")


def test_a_job_that_catches_its_oom_and_exits_0_is_an_oom(tmp_path):
    """issue 49 item 6: ViT-B/16 under a 4 GiB cap, catching its OOM (``except torch.OutOfMemoryError``, exit 0).
    A micro-batch that does not fit is 'oom' from memory_stats' num_ooms, with exit code 0; one that fits is
    'ran' from the stop after 2 optimizer steps (before: exit code 0 was 'ran', and fit answered the top)."""
    code, doc, err = oomdoctor("fit", "--no-record", "--start", "16", "--high", "256", "--out", str(tmp_path),
                               "--format", "json", "--", sys.executable, VIT, "--cap-gib", "4", "--catch-oom",
                               "--batch", "{mb}")
    assert code == 0, err[-3000:]
    answer = doc["largest_micro_batch"]
    # about 65 MiB an image (2,135 fit an H200, issue 49) and 1.4 GB of weights, gradients and AdamW state: ~40
    assert answer is not None and doc["smallest_oom_micro_batch"] == answer + 1 and answer < 256
    above = [t for t in doc["trials"] if t["micro_batch"] > answer]
    assert above and all((t["outcome"], t["evidence"], t["exit_code"]) == ("oom", "num-ooms", 0) for t in above)
    assert all(t["evidence"] == "stop" and t["stopped"] for t in doc["trials"] if t["micro_batch"] <= answer)
    print(json.dumps({"answer": answer, "trials": [(t["micro_batch"], t["outcome"], t["evidence"])
                                                   for t in doc["trials"]]}))


def test_fit_refuses_where_no_device_is_visible(tmp_path):
    env_code = subprocess.run([sys.executable, "-m", "oomdoctor", "fit", "--out", str(tmp_path / "f"), "--",
                               sys.executable, VIT, "--batch", "{mb}"], capture_output=True, text=True, timeout=300,
                              cwd=ROOT, env=dict(os.environ, CUDA_VISIBLE_DEVICES="",
                                                 PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                                             os.environ.get("PYTHONPATH", "")])))
    assert env_code.returncode == 2 and env_code.stdout == ""
    assert env_code.stderr.count("\n") == 1 and "no CUDA device is visible" in env_code.stderr
    assert not (tmp_path / "f").exists()
