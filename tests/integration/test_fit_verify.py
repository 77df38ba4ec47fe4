"""``oomdoctor fit`` and ``oomdoctor verify`` end to end on the CPU, with a stand-in job (``tests/standin_job.py``)
that prints PyTorch's real CUDA out-of-memory message and exits 1 above a micro-batch limit. Where a test needs a
recording, the stand-in copies a real snapshot recorded on H200s into the run's directory, as the recorder would
have written it there on a GPU: the diagnosis, the replays and the claims are the real ones."""

from __future__ import annotations

import json
import sys
import tarfile
from pathlib import Path

import jsonschema
import pytest

from oomdoctor.cli.main import main
from oomdoctor.render.schema import schema

ROOT = Path(__file__).resolve().parents[2]
STANDIN = str(ROOT / "tests" / "standin_job.py")
JOB = [sys.executable, STANDIN]


def oomdoctor(capsys, monkeypatch, spec: dict, *args: str) -> tuple[int, str, str]:
    monkeypatch.setenv("STANDIN", json.dumps(spec))
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def valid(command: str, doc: dict) -> dict:
    errors = [e.message for e in jsonschema.Draft202012Validator(schema(command)).iter_errors(doc)]
    assert errors == []
    return doc


# -------------------------------------------------------------------------------------------------- fit


def test_fit_by_trials_alone_finds_the_limit(capsys, monkeypatch, tmp_path):
    code, out, err = oomdoctor(capsys, monkeypatch, {"limit": 37}, "fit", "--high", "200", "--out",
                               str(tmp_path), "--format", "json", "--", *JOB, "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 0
    assert doc["largest_micro_batch"] == 37 and doc["smallest_oom_micro_batch"] == 38
    assert [t["micro_batch"] for t in doc["trials"]] == [1, 2, 4, 8, 16, 32, 64, 48, 40, 36, 38, 37]
    assert doc["trial_count"] == 12 and doc["guide"] == "none" and doc["snapshot"] is False
    assert [t["outcome"] for t in doc["trials"]].count("oom") == 4
    assert all(t["exit_code"] == (1 if t["outcome"] == "oom" else 0) for t in doc["trials"])
    assert doc["seconds"] >= sum(t["seconds"] for t in doc["trials"]) - 0.1
    assert err.count("oomdoctor: micro-batch") == 12
    # each trial's output is kept
    assert "CUDA out of memory. Tried to allocate 16.00 GiB" in Path(doc["trials"][6]["log"]).read_text()


@pytest.fixture(scope="module")
def b88(tmp_path_factory) -> Path:
    """A Hugging Face Trainer DDP run at micro-batch 88 on 2 H200s, healthy (its sweep: 88 runs, 96 does not)."""
    d = tmp_path_factory.mktemp("b88")
    with tarfile.open(ROOT / "docs" / "corpus" / "trainer-ddp-gpt2-b88.tar.xz") as tar:
        tar.extractall(d, filter="data")
    return d / "trainer-ddp-gpt2-b88"


def test_fit_starts_at_the_replayed_answer(capsys, monkeypatch, tmp_path, b88):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 92, "snapshot": str(b88)}, "fit", "--start", "88",
                             "--out", str(tmp_path), "--format", "json", "--", *JOB, "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 0
    # the replay of the recorded run at 88 says 94 fits (issue 49: the margin counts the memory outside the
    # allocator once; 94 is the largest its sweep ran on the GPU): the first trial after it is there, then down
    assert doc["snapshot"] is True and doc["guide"] == "replayed" and doc["predicted_micro_batch"] == 94
    assert [(t["micro_batch"], t["outcome"]) for t in doc["trials"]][:2] == [(88, "ran"), (94, "oom")]
    assert doc["trials"][-1]["micro_batch"] in (92, 93) and doc["largest_micro_batch"] == 92
    assert [t["recorded"] for t in doc["trials"]] == [True] + [False] * (len(doc["trials"]) - 1)
    assert doc["analysis_seconds"] > 0


def test_fit_text_says_the_answer_the_trials_and_the_guide(capsys, monkeypatch, tmp_path, b88):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 94, "snapshot": str(b88)}, "fit", "--start", "88",
                             "--out", str(tmp_path), "--", *JOB, "--mb", "{mb}")
    assert code == 0
    # the replayed 94 (issue 49's margin) ran: the search goes up from it, one step
    assert out.startswith("Largest micro-batch that runs: 94; 95 ran out of memory.\n3 trials of 2 optimizer steps")
    assert "Guided: the replay of the recorded run says 94 fits" in out


def test_fit_when_nothing_runs_or_a_trial_fails(capsys, monkeypatch, tmp_path):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 2}, "fit", "--low", "3", "--out", str(tmp_path / "a"),
                             "--format", "json", "--", *JOB, "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 1 and doc["largest_micro_batch"] is None and doc["smallest_oom_micro_batch"] == 3
    code, out, _ = oomdoctor(capsys, monkeypatch, {}, "fit", "--out", str(tmp_path / "b"), "--format", "json",
                             "--", sys.executable, "-c", "import sys; sys.exit(3)", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 2 and doc["error"] == "failed" and doc["trials"][0]["exit_code"] == 3


def test_fit_needs_the_micro_batch_in_the_command(capsys, monkeypatch):
    code, _, err = oomdoctor(capsys, monkeypatch, {}, "fit", "--", *JOB, "--mb", "8")
    assert code == 2 and "no {mb}" in err
    code, _, err = oomdoctor(capsys, monkeypatch, {}, "fit", "--", "no-such-command-xyz", "{mb}")
    assert code == 127 and "command not found" in err


# ----------------------------------------------------------------------------------------------- verify

@pytest.fixture
def frag(snapshots) -> str:
    """A real OOM recorded on an H200: the default allocator ran out of memory at step 7 with 7.67 GiB reserved
    but unallocated; the diagnosis proposes expandable segments, max_split_size_mb and garbage collection."""
    return str(snapshots / "fragmentation-oom" / "default-oom.pickle")


def test_verify_confirms_and_refutes_the_diagnosis_claims(capsys, monkeypatch, tmp_path, frag):
    # the reruns: expandable segments runs, max_split_size_mb:1024 and the garbage collector run out of memory
    spec = {"limit": 0, "fixes": {"expandable_segments:True": 10}, "snapshot": frag,
            "peaks": {"expandable_segments:True": 37_000_000_000}}
    code, out, err = oomdoctor(capsys, monkeypatch, spec, "verify", "--out", str(tmp_path), "--format", "json",
                               "--", *JOB)
    doc = valid("verify", json.loads(out))
    assert code == 1 and doc["refuted"] == 1
    assert doc["snapshot"] is True and doc["source"] == "diagnosis"
    assert doc["baseline"]["outcome"] == "oom" and doc["baseline"]["recorded"] is True
    rows = {s["config"]: s for s in doc["settings"]}
    assert list(rows) == ["PYTORCH_ALLOC_CONF=expandable_segments:True", "PYTORCH_ALLOC_CONF=max_split_size_mb:1024",
                          "PYTORCH_ALLOC_CONF=garbage_collection_threshold:0.8"]
    e = rows["PYTORCH_ALLOC_CONF=expandable_segments:True"]
    assert e["env"] == {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    assert e["predicted_oom"] is False and e["oom"] is False and e["measured_peak_reserved_bytes"] == 37_000_000_000
    assert abs(e["measured_peak_reserved_bytes"] - e["predicted_peak_reserved_bytes"]) <= e["margin_bytes"]
    assert (e["confirmed"], e["why"]) == (True, "agrees")
    m = rows["PYTORCH_ALLOC_CONF=max_split_size_mb:1024"]
    assert (m["predicted_oom"], m["oom"], m["confirmed"], m["why"]) == (False, True, False, "oom-not-predicted")
    g = rows["PYTORCH_ALLOC_CONF=garbage_collection_threshold:0.8"]
    assert (g["predicted_oom"], g["oom"], g["confirmed"], g["why"]) == (True, True, True, "agrees")
    # the recording ran out of memory at its 8th step (7 completed): each rerun runs past it
    assert doc["steps"] == 3 and doc["rerun_steps"] == 8


def test_verify_refutes_a_peak_outside_the_margin_and_exits_0_when_all_agree(capsys, monkeypatch, tmp_path, frag):
    base = {"limit": 0, "fixes": {"expandable_segments:True": 10}, "snapshot": frag}
    code, out, _ = oomdoctor(capsys, monkeypatch, base | {"peaks": {"expandable_segments:True": 37_000_000_000}},
                             "verify", "--setting", "expandable_segments:True", "--out", str(tmp_path / "a"),
                             "--", *JOB)
    assert code == 0
    assert "predicted: runs, peak 34.78 GiB ± 5.99 GiB" in out and "measured:  ran, peak 34.46 GiB" in out
    assert "1 of 1 claims confirmed, 0 refuted" in out
    code, out, _ = oomdoctor(capsys, monkeypatch, base | {"peaks": {"expandable_segments:True": 80 << 30}},
                             "verify", "--setting", "expandable_segments:True", "--out", str(tmp_path / "b"),
                             "--format", "json", "--", *JOB)
    doc = valid("verify", json.loads(out))
    assert code == 1 and doc["settings"][0]["why"] == "peak-above-margin"


def test_verify_without_a_snapshot_reruns_the_settings_given(capsys, monkeypatch, tmp_path):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 0, "fixes": {"TORCH_NCCL_AVOID_RECORD_STREAMS=1": 5}},
                             "verify", "--setting", "TORCH_NCCL_AVOID_RECORD_STREAMS=1", "--out", str(tmp_path / "a"),
                             "--format", "json", "--", *JOB)
    doc = valid("verify", json.loads(out))
    assert code == 0 and doc["snapshot"] is False and doc["baseline"]["outcome"] == "oom"
    s = doc["settings"][0]
    assert (s["oom"], s["confirmed"], s["why"], s["predicted_oom"]) == (False, None, "no-prediction", None)
    code, _, err = oomdoctor(capsys, monkeypatch, {}, "verify", "--out", str(tmp_path / "b"), "--", *JOB)
    assert code == 2 and "nothing to verify" in err
    code, _, err = oomdoctor(capsys, monkeypatch, {}, "verify", "--setting", "max_split_size_mb:2", "--", *JOB)
    assert code == 2 and "max_split_size_mb" in err


# ------------------------------------------------------------------------------- the stop after K steps


def test_a_training_loop_stops_itself_after_k_optimizer_steps(capsys, monkeypatch, tmp_path):
    """The stand-in's loop never ends by itself: only the injected stop ends it, with exit code 0."""
    code, out, _ = oomdoctor(capsys, monkeypatch, {}, "verify", "--steps", "3", "--setting", "NCCL_DEBUG=WARN",
                             "--out", str(tmp_path), "--format", "json", "--", *JOB, "--train")
    doc = valid("verify", json.loads(out))
    assert code == 0
    for t in (doc["baseline"], doc["settings"][0]["trial"]):
        assert t["outcome"] == "ran" and t["exit_code"] == 0 and t["stopped"] is True
        log = Path(t["log"]).read_text()
        # the stop ends the process inside the 3rd optimizer.step(): the loop's print after it never runs
        assert "step 2\n" in log and "step 3" not in log
        assert "oomdoctor: stopped after 3 optimizer steps" in log


def test_every_rank_of_a_torchrun_job_stops_at_the_same_step(tmp_path):
    """2 ranks (gloo, an all-reduce per step) under torchrun: both stop inside their 2nd optimizer step, torchrun
    exits 0. The ranks' lines interleave in the log (two processes, one pipe): each is looked for by its rank."""
    from oomdoctor.cli.trials import run_trial
    t = run_trial([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", STANDIN, "--train", "--dist"],
                  str(tmp_path / "run"), steps=2, record=False, timeout_s=240)
    log = Path(t.log).read_text()
    assert t.outcome == "ran" and t.exit_code == 0 and not t.timed_out
    assert log.count("stopped after 2 optimizer steps") == 2
    assert "rank 0): exit 0" in log and "rank 1): exit 0" in log
    assert "step 1 (rank 0)" in log and "step 1 (rank 1)" in log and "step 2" not in log


def test_fit_without_recording_says_so(capsys, monkeypatch, tmp_path):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 3}, "fit", "--no-record", "--high", "4", "--out",
                             str(tmp_path), "--", *JOB, "--mb", "{mb}")
    assert code == 0
    assert out.startswith("Largest micro-batch that runs: 3; 4 ran out of memory.\n4 trials")
    assert "Searched by trials alone: recording was off (--no-record)." in out
    assert [line.split()[0] for line in out.splitlines()[5:]] == ["1", "2", "4", "3"]
