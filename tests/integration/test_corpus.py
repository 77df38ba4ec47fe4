"""The real-job corpus (docs/corpus/): snapshots of third-party training loops recorded under ``oomdoctor run``
on GPUs, with the ground truth the job measured itself. Here: peaks and the OOM against that truth."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from oomdoctor.report import build_report
from oomdoctor.trace import load_ranks

CORPUS = Path(__file__).resolve().parents[2] / "docs" / "corpus"


def unpack(tmp_path: Path, name: str) -> Path:
    with tarfile.open(CORPUS / f"{name}.tar.xz") as tar:
        tar.extractall(tmp_path, filter="data")
    return tmp_path / name


@pytest.mark.parametrize("name", ["trainer-ddp-gpt2-b88", "trainer-ddp-gpt2-b96", "trainer-ddp-gpt2-eval-accumulate",
                                  "trainer-ddp-gpt2-checkpointing-b88"])
def test_peaks_match_what_the_job_measured(tmp_path, name):
    run = unpack(tmp_path, name)
    truth = json.loads((run / "ground_truth.json").read_text())  # rank 0's torch.cuda.max_memory_*
    skipped = []
    report = build_report(load_ranks([run], skipped=skipped))
    assert sorted(Path(s.path).name for s in skipped) == ["ground_truth.json", "job.log"]
    r0 = report.ranks[0]
    assert r0.peak_reserved_bytes == truth["max_memory_reserved"]
    # recording starts at CUDA's initialisation, after a few allocations: within 0.05%
    assert abs(r0.peak_allocated_bytes - truth["max_memory_allocated"]) <= 5e-4 * truth["max_memory_allocated"]


def test_the_capacity_oom_is_recorded_at_the_failure(tmp_path):
    run = unpack(tmp_path, "trainer-ddp-gpt2-b96")
    truth = json.loads((run / "ground_truth.json").read_text())
    assert truth["oom"].startswith("CUDA out of memory. Tried to allocate 18.41 GiB")
    report = build_report(load_ranks([run], skipped=[]))
    for r in report.ranks:
        assert r.oom is not None and round(r.oom.requested_bytes / 2**30, 2) == 18.40
    sweep = [json.loads(ln) for ln in (CORPUS / "trainer-ddp-gpt2-sweep.jsonl").read_text().splitlines()]
    fits = [s["batch"] for s in sweep if s["exit_code"] == 0]
    assert max(fits) == 88 and min(s["batch"] for s in sweep if s["exit_code"] != 0) == 96


def test_the_eval_oom_is_every_batchs_logits_gathered_on_the_gpu(tmp_path):
    """Trainer.evaluate() with compute_metrics keeps every eval batch's logits on the GPU: the request that
    failed is all of them at once, 384 samples x 1024 tokens x 50,257 logits x 4 bytes."""
    run = unpack(tmp_path, "trainer-ddp-gpt2-eval-accumulate")
    truth = json.loads((run / "ground_truth.json").read_text())
    assert truth["oom"].startswith("CUDA out of memory. Tried to allocate 73.62 GiB")
    assert truth["train_max_memory_allocated"] < truth["max_memory_allocated"] / 5  # the peak is the eval's
    report = build_report(load_ranks([run], skipped=[]))
    expected = truth["eval_samples"] * truth["seq"] * truth["vocab"] * 4
    assert [r.oom.requested_bytes for r in report.ranks] == [expected, expected] == [79_047_426_048] * 2


def test_checkpointing_halves_the_peak_of_the_same_batch(tmp_path):
    plain = json.loads(tarfile.open(CORPUS / "trainer-ddp-gpt2-b88.tar.xz").extractfile(
        "trainer-ddp-gpt2-b88/ground_truth.json").read())
    ckpt = json.loads(tarfile.open(CORPUS / "trainer-ddp-gpt2-checkpointing-b88.tar.xz").extractfile(
        "trainer-ddp-gpt2-checkpointing-b88/ground_truth.json").read())
    assert ckpt["gradient_checkpointing"] and ckpt["batch"] == plain["batch"] == 88
    assert ckpt["max_memory_allocated"] == 60_295_796_736 and plain["max_memory_allocated"] == 128_640_581_120
