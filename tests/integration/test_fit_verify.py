"""``oomdoctor fit`` and ``oomdoctor verify`` end to end on the CPU, with a stand-in job (``tests/standin_job.py``)
that prints PyTorch's real CUDA out-of-memory message and exits 1 above a micro-batch limit, and below it writes
the exit record the injected stop writes. Where a test needs a recording, the stand-in copies a real snapshot
recorded on H200s into the run's directory, as the recorder would have written it there on a GPU (and, for a
rerun, the sidecars of the real rerun with that setting): the diagnosis, the replays, the claims and the measured
peaks are the real ones. This machine has no GPU: every call but the refusal's passes ``--allow-no-gpu``."""

from __future__ import annotations

import json
import shutil
import sys
import tarfile
import time
from pathlib import Path

import jsonschema
import pytest

from oomdoctor.capture.exits import exit_record, read_exit_records, write_exit_record
from oomdoctor.cli.main import main
from oomdoctor.cli.trials import measured_peak
from oomdoctor.render.schema import schema
from oomdoctor.report.loop import EXTRA_TRIALS

ROOT = Path(__file__).resolve().parents[2]
STANDIN = str(ROOT / "tests" / "standin_job.py")
JOB = [sys.executable, STANDIN]


def oomdoctor(capsys, monkeypatch, spec: dict, *args: str, allow_no_gpu: bool = True) -> tuple[int, str, str]:
    """``oomdoctor ARGS`` with the stand-in's ``spec``; ``--allow-no-gpu`` after the command name (this machine
    has no GPU: the stand-in is the job) unless ``allow_no_gpu`` is False."""
    monkeypatch.setenv("STANDIN", json.dumps(spec))
    code = main([args[0], *(["--allow-no-gpu"] if allow_no_gpu else []), *args[1:]])
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


def corpus(tmp_path_factory, name: str) -> Path:
    d = tmp_path_factory.mktemp(name)
    with tarfile.open(ROOT / "docs" / "corpus" / f"{name}.tar.xz") as tar:
        tar.extractall(d, filter="data")
    return d / name


@pytest.fixture(scope="module")
def b88(tmp_path_factory) -> Path:
    """A Hugging Face Trainer DDP run at micro-batch 88 on 2 H200s, healthy (its sweep: 88 runs, 96 does not)."""
    return corpus(tmp_path_factory, "trainer-ddp-gpt2-b88")


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


def test_fit_takes_the_tightest_rank(capsys, monkeypatch, tmp_path, b88):
    """The b88 run with rank 1 under a memory-fraction cap of 133 GiB (its sidecar's memory_cap_bytes): rank 0's
    replay says 94 fits, rank 1's 90. The first guided trial is 90, the smallest over the ranks."""
    capped = tmp_path / "capped"
    shutil.copytree(b88, capped)
    meta = json.loads((capped / "rank1.meta.json").read_text())
    meta["memory_cap_bytes"] = 133 << 30
    (capped / "rank1.meta.json").write_text(json.dumps(meta))
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 90, "snapshot": str(capped)}, "fit", "--start", "88",
                             "--out", str(tmp_path / "fit"), "--format", "json", "--", *JOB, "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 0 and doc["guide"] == "replayed" and doc["predicted_micro_batch"] == 90
    assert [(t["micro_batch"], t["outcome"]) for t in doc["trials"]] == [(88, "ran"), (90, "ran"), (91, "oom")]


@pytest.mark.parametrize("limit", [92, 94, 150, 700])
def test_the_guided_fit_is_bounded_by_the_doubling_fit(capsys, monkeypatch, tmp_path, b88, limit):
    """Stand-ins whose edge is known, from the same start (88): the search guided by the replay (it says 94, issue
    49's margin: see test_fit_starts_at_the_replayed_answer) against the doubling search (--no-record), each with
    real trials. The same answer, and never more than
    EXTRA_TRIALS trials beyond the doubling search; fewer near the guess."""
    runs = {}
    for how in ("guided", "doubling"):
        code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": limit, "snapshot": str(b88)}, "fit", "--start", "88",
                                 "--high", "1024", *(["--no-record"] if how == "doubling" else []), "--out",
                                 str(tmp_path / how), "--format", "json", "--", *JOB, "--mb", "{mb}")
        runs[how] = valid("fit", json.loads(out))
        assert code == 0 and runs[how]["largest_micro_batch"] == limit
    assert runs["guided"]["predicted_micro_batch"] == 94 and runs["doubling"]["guide"] == "none"
    g, d = runs["guided"]["trial_count"], runs["doubling"]["trial_count"]
    assert g <= d + EXTRA_TRIALS
    if limit in (92, 94):
        assert g <= 5 < d


def test_a_job_that_catches_its_oom_and_exits_0_did_not_run(capsys, monkeypatch, tmp_path):
    """Above its limit the stand-in catches the OOM, says "skipping" and exits 0 (no stop after K steps). On a GPU
    the injection's exit record says num_ooms 1: an OOM. Without CUDA nothing says so: it ended before its K
    steps, and fit stops there (exit code 2) rather than count it as a run."""
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 5, "cuda": True}, "fit", "--high", "8", "--out",
                             str(tmp_path / "gpu"), "--format", "json", "--", *JOB, "--catch", "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 0 and doc["largest_micro_batch"] == 5 and doc["smallest_oom_micro_batch"] == 6
    assert {(t["outcome"], t["evidence"], t["exit_code"]) for t in doc["trials"] if t["micro_batch"] > 5} == {
        ("oom", "num-ooms", 0)}
    assert {t["evidence"] for t in doc["trials"] if t["micro_batch"] <= 5} == {"stop"}
    assert all(t["stopped"] == (t["micro_batch"] <= 5) for t in doc["trials"])
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 5}, "fit", "--high", "8", "--out", str(tmp_path / "cpu"),
                             "--format", "json", "--", *JOB, "--catch", "--mb", "{mb}")
    doc = valid("fit", json.loads(out))
    assert code == 2 and doc["error"] == "ended-early" and doc["largest_micro_batch"] == 4
    assert (doc["trials"][-1]["micro_batch"], doc["trials"][-1]["outcome"]) == (8, "ended-early")
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 5}, "fit", "--high", "8", "--out", str(tmp_path / "t"),
                             "--", *JOB, "--catch", "--mb", "{mb}")
    assert "No answer: a trial exited 0 before its 2 optimizer steps" in out


def test_fit_and_verify_refuse_at_once_without_a_gpu(capsys, monkeypatch, tmp_path):
    """This machine has no CUDA device: without --allow-no-gpu both refuse in one line, exit 2, before any trial
    (before: a CPU-only job 'fit 4096' after 13 trials, exit 0)."""
    for cmd in (["fit", "--out", str(tmp_path / "fit"), "--", *JOB, "--mb", "{mb}"],
                ["verify", "--setting", "expandable_segments:True", "--out", str(tmp_path / "verify"), "--", *JOB]):
        code, out, err = oomdoctor(capsys, monkeypatch, {}, *cmd, allow_no_gpu=False)
        assert code == 2 and out == ""
        assert err.count("\n") == 1 and err.startswith(f"oomdoctor: error: {cmd[0]}: no CUDA device is visible (")
        assert "--allow-no-gpu" in err
        assert not (tmp_path / cmd[0]).exists()


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
    assert "1 of 1 claim confirmed, 0 refuted" in out
    code, out, _ = oomdoctor(capsys, monkeypatch, base | {"peaks": {"expandable_segments:True": 80 << 30}},
                             "verify", "--setting", "expandable_segments:True", "--out", str(tmp_path / "b"),
                             "--format", "json", "--", *JOB)
    doc = valid("verify", json.loads(out))
    assert code == 1 and doc["settings"][0]["why"] == "peak-above-margin"


@pytest.fixture(scope="module")
def fsdp2_b120(tmp_path_factory) -> tuple[Path, Path]:
    """A Trainer FSDP2 run on 2 H200s that ran out of memory at micro-batch 120 in its second step, and the same
    run with expandable_segments:True, which ran 3 steps (docs/corpus/README.md)."""
    return (corpus(tmp_path_factory, "trainer-fsdp2-gpt2-b120"),
            corpus(tmp_path_factory, "trainer-fsdp2-gpt2-b120-expandable"))


def test_verify_on_two_ranks_judges_the_extended_step_inside_its_band(capsys, monkeypatch, tmp_path, fsdp2_b120):
    """Both ranks' replays get past the recorded OOM with expandable segments and complete the step; the rest of
    the step, replayed as the previous step ran it, raises the peak from 141,335,461,888 (the recorded events) to
    141,421,445,120 B, but with one complete step before the OOM no margin of it was measured (issue 49: a condition,
    not a number): the claim commits to the recorded events, a lower bound, with their own margin, 2,097,152 B (the
    self-replay exact, and the growth of the memory outside the allocator after the first optimizer step). The real rerun's
    sidecars measured 141,761,183,744 B on each rank (0.24% above the extended replay): above the band's low end,
    confirmed (refuted before, against a band of +-2 MiB around the extended replay)."""
    oom, expandable = fsdp2_b120
    spec = {"limit": 0, "fixes": {"expandable_segments:True": 10}, "snapshot": str(oom),
            "sidecars": {"expandable_segments:True": str(expandable)}}
    code, out, _ = oomdoctor(capsys, monkeypatch, spec, "verify", "--setting", "expandable_segments:True", "--out",
                             str(tmp_path), "--format", "json", "--", *JOB)
    doc = valid("verify", json.loads(out))
    assert code == 0 and doc["baseline"]["outcome"] == "oom" and doc["baseline"]["evidence"] == "oom-dump"
    s = doc["settings"][0]
    assert (s["predicted_peak_reserved_bytes"], s["margin_bytes"], s["margin_source"]) == (
        141_335_461_888, 2_097_152, "prediction")
    assert (s["band_low_bytes"], s["band_high_bytes"]) == (141_335_461_888 - 2_097_152, None)
    assert s["reach"] == "step-completed" and s["predicted_peak_is_lower_bound"] is True
    assert s["measured_peak_reserved_bytes"] == 141_761_183_744 and (s["confirmed"], s["why"]) == (True, "agrees")
    assert doc["rerun_steps"] == 2  # through the step that ran out (1 completed before it)


def test_verify_on_two_ranks_takes_the_highest_measured_peak_against_a_lower_bound(capsys, monkeypatch, tmp_path,
                                                                                    tmp_path_factory):
    """An accelerate Llama run on 2 H200s ran out of memory at micro-batch 76 in its first step: the replay with
    expandable segments gets past the recorded OOM, but with no complete step before it, the rest of the step is
    not replayed: its 144,697,196,544 B is a lower bound. Its margin is issue 49's: the self-replay exact, and the
    growth of the memory outside the allocator before the first optimizer step, 96,468,992 B (92 MiB, measured; the OOM
    came before any). The real rerun with expandable segments measured 146,123,259,904 B on rank 0 and
    148,262,354,944 B on rank 1: the measured peak is rank 1's, above the prediction plus its margin
    (144,793,665,536 B), which a lower bound allows."""
    oom = corpus(tmp_path_factory, "accelerate-ddp-llama-b76")
    expandable = corpus(tmp_path_factory, "accelerate-ddp-llama-b76-expandable")
    spec = {"limit": 0, "fixes": {"expandable_segments:True": 10}, "snapshot": str(oom),
            "sidecars": {"expandable_segments:True": str(expandable)}}
    code, out, _ = oomdoctor(capsys, monkeypatch, spec, "verify", "--setting", "expandable_segments:True", "--out",
                             str(tmp_path), "--format", "json", "--", *JOB)
    doc = valid("verify", json.loads(out))
    s = doc["settings"][0]
    assert s["measured_peak_reserved_bytes"] == 148_262_354_944
    assert (s["predicted_peak_reserved_bytes"], s["margin_bytes"]) == (144_697_196_544, 96_468_992)
    assert s["reach"] == "recorded" and s["predicted_peak_is_lower_bound"] is True
    assert (s["band_low_bytes"], s["band_high_bytes"]) == (144_697_196_544 - 96_468_992, None)
    assert code == 0 and (s["confirmed"], s["why"]) == (True, "agrees")


def test_the_measured_peak_is_the_highest_rank_of_this_run(tmp_path):
    out, exits = tmp_path / "run", tmp_path / "run.exits"
    out.mkdir()
    for rank, peak in ((0, 7 * 2**30), (1, 9 * 2**30)):
        (out / f"rank{rank}.meta.json").write_text(json.dumps({"rank": rank, "memory_stats": {
            "reserved_bytes.all.peak": peak}}))
    assert measured_peak(str(out)) == 9 * 2**30
    # an exit record of rank 0 at the stop, later than its dump: its peak counts
    write_exit_record(str(exits), exit_record(stopped=True, steps=2, steps_asked=2, rank=0, pid=11, cuda=True,
                                              memory_stats={"reserved_bytes.all.peak": 10 * 2**30, "num_ooms": 0}))
    assert measured_peak(str(out), str(exits)) == 10 * 2**30
    assert [r["pid"] for r in read_exit_records(str(exits))] == [11]
    # sidecars left by an earlier run in the same directory are not this run's
    assert measured_peak(str(out), since=time.time() + 5) is None
    (out / "rank1.meta.json").write_text("{not json")
    assert measured_peak(str(out)) == 7 * 2**30


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
        # the stop's own record says so, not the log: that is what made it 'ran'
        assert t["evidence"] == "stop"
        recs = read_exit_records(t["log"][: -len(".log")] + ".exits")
        assert [(r["stopped"], r["steps"], r["steps_asked"], r["cuda"], r["memory_stats"]) for r in recs] == [
            (True, 3, 3, False, None)]


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
    recs = read_exit_records(str(tmp_path / "run.exits"))
    assert sorted((r["rank"], r["stopped"], r["steps"]) for r in recs) == [(0, True, 2), (1, True, 2)]
    assert t.evidence == "stop" and t.stopped


def test_fit_without_recording_says_so(capsys, monkeypatch, tmp_path):
    code, out, _ = oomdoctor(capsys, monkeypatch, {"limit": 3}, "fit", "--no-record", "--high", "4", "--out",
                             str(tmp_path), "--", *JOB, "--mb", "{mb}")
    assert code == 0
    assert out.startswith("Largest micro-batch that runs: 3; 4 ran out of memory.\n4 trials")
    assert "Searched by trials alone: recording was off (--no-record)." in out
    assert [line.split()[0] for line in out.splitlines()[5:]] == ["1", "2", "4", "3"]
