"""The planner (``--framework hf``) against the real-job corpus (docs/corpus/): every run that finished within
10% of the peak the job measured itself, no run that ran out of memory predicted to fit, and the peak's
categories against ``oomdoctor diagnose``'s breakdown of the recorded run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("plan_corpus", ROOT / "benchmarks" / "plan_corpus.py")
plan_corpus = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(plan_corpus)

ROWS = plan_corpus.rows()


def test_the_corpus_has_the_runs_it_claims():
    jobs = {r["job"] for r in ROWS}
    assert {"trainer-ddp-gpt2", "trainer-fsdp2-gpt2", "lightning-fsdp-gpt2", "accelerate-ddp-llama"} <= jobs
    assert sum(1 for r in ROWS if r["exit_code"] == 0) >= 31 and sum(1 for r in ROWS if r["exit_code"]) >= 10
    assert sum(1 for r in ROWS if r["job"].startswith("holdout-")) == 6  # recorded after the terms were written


@pytest.mark.parametrize("row", [r for r in ROWS if r["exit_code"] == 0], ids=lambda r: r["run"])
def test_finished_runs_are_predicted_within_10_percent(row):
    e = plan_corpus.predict(row)
    if isinstance(e, str):
        assert row["job"] == "compiled-lm", e  # the only finished runs refused: torch.compile
        return
    got, truth = e.stages[0].allocated_bytes, row["max_memory_allocated"]
    assert abs(got - truth) <= 0.10 * truth, (got, truth)
    # measured: within 1.4% on every run (the largest: DDP's second bucket set, counted as an upper bound, and a
    # Lightning run whose own peak varies by that set between runs: docs/plan.md)
    assert abs(got - truth) <= 0.02 * truth, (got, truth)


@pytest.mark.parametrize("row", [r for r in ROWS if r["exit_code"] != 0], ids=lambda r: r["run"])
def test_no_run_that_ran_out_of_memory_is_predicted_to_fit(row):
    e = plan_corpus.predict(row)
    if isinstance(e, str):
        assert row["job"] in ("compiled-lm", "lightning-ddp-gpt2-val-logits", "trainer-ddp-gpt2-eval-accumulate")
        return
    assert e.fits is False
    # and what it ran out of memory on is more than the GPU: the prediction with a fragmentation-free allocator
    assert e.stages[0].allocated_bytes > row["max_memory_allocated"] * 0.95


@pytest.mark.parametrize("name", ["trainer-ddp-gpt2-b88", "trainer-fsdp2-gpt2-b112", "lightning-fsdp-gpt2-b96",
                                  "accelerate-ddp-llama-b72", "trainer-ddp-gpt2-checkpointing-b88"])
def test_the_peak_by_category_matches_diagnose(tmp_path, name):
    row = next(r for r in ROWS if r["run"] == name)
    e = plan_corpus.predict(row)
    got = e.stages[0].categories
    seen = plan_corpus.diagnose_categories(name, tmp_path)
    peak = sum(seen.values())
    for c in plan_corpus.CATEGORIES:
        assert abs(got.get(c, 0) - seen.get(c, 0)) <= 0.005 * peak, (c, got, seen)
